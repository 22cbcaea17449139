"""Sphinx + MyST-NB: the tutorials executed with their figures, tables and widget state, and the
README's reference sections. Built by `make docs` into build/docs (an artifact, not committed)."""

project = "ampnb"
author = "the ampnb developers"
extensions = ["myst_nb"]

# The source is the repository root (the notebooks live in notebooks/); only these are read.
root_doc = "docs/index"
include_patterns = ["docs/*.md", "notebooks/*.ipynb"]
exclude_patterns = ["build", ".venv", "**/.ipynb_checkpoints"]

# Every notebook runs at build time: the committed notebooks keep only checked text outputs.
nb_execution_mode = "force"
nb_execution_timeout = 300  # a cell that hangs fails the build instead
nb_execution_raise_on_error = True  # a cell that fails fails the build
nb_execution_show_tb = True
nb_merge_streams = True
# stderr stays out of the pages: the warnings a tutorial shows (an FP8 layer left out, say) are
# discussed in its prose, and a warning in a page would fail the build (-W).
nb_output_stderr = "remove"
nb_kernel_rgx_aliases = {".*": "python3"}

myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3
suppress_warnings = ["myst.header"]  # the notebooks start at a level-1 title, then level 3

html_theme = "alabaster"
html_title = "ampnb: see and poke PyTorch mixed precision"
html_static_path: list[str] = []
