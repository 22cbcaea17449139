"""Sphinx + MyST-NB: the tutorials executed with their figures, tables and widget state, and the
reference pages (docs/*.md). Built by `make docs` into build/docs (an artifact, not committed)."""

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

# The widget manager that draws the panels' saved state ships with the site (docs/_static/widgets,
# from npm by docs/vendor_widgets.py): no CDN, so the panels appear offline. embed.js is the
# standalone bundle (base, controls and output widgets), so require.js is not needed either.
nb_ipywidgets_js = {"widgets/embed.js": {}}

# pydata-sphinx-theme, as numpy, pandas and Jupyter use: a wide content column; ampnb.css lets
# wide outputs (tables, code, repr text) scroll inside their cell instead of overflowing it.
html_theme = "pydata_sphinx_theme"
html_title = "ampnb"
html_static_path = ["_static"]
html_css_files = ["ampnb.css"]
html_theme_options = {
    "navigation_with_keys": False,
    "header_links_before_dropdown": 2,  # the tutorials' long titles fill the bar otherwise
    "show_toc_level": 2,
    "secondary_sidebar_items": ["page-toc"],
    "footer_start": ["copyright"],
    "footer_end": ["sphinx-version"],
}
# The pages are listed in the top bar; no left sidebar, so the article gets the width.
html_sidebars: dict[str, list[str]] = {"**": []}
copyright = "the ampnb developers; MIT licence"  # noqa: A001 - Sphinx's own setting name


def _drop_nbval_markers(app: object, docname: str, source: list[str]) -> None:
    """The `# NBVAL_CHECK_OUTPUT` lines tell nbval which outputs to compare; readers need not see them."""
    if docname.startswith("notebooks/"):
        source[0] = source[0].replace('"# NBVAL_CHECK_OUTPUT\\n",', "").replace(
            '"# NBVAL_CHECK_OUTPUT\\n"', '""')


def setup(app: object) -> None:
    app.connect("source-read", _drop_nbval_markers)
