"""The tutorials as files: built from their scripts, one kernel, checked outputs stored, no noise."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jupytext
import nbformat
import pytest
from _magics_kit import load_script
from nbformat.v4 import new_code_cell, new_output

DIR = Path(__file__).resolve().parents[1] / "notebooks"  # what JupyterLab opens: the tutorials
SRC = DIR / "src"  # their scripts and the tooling that builds and checks them
NOTEBOOKS = sorted(DIR.glob("[0-9][0-9]_*.ipynb"))
SCRIPTS = sorted(SRC.glob("[0-9][0-9]_*.py"))
CHECK = "# NBVAL_CHECK_OUTPUT"
TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d")  # ISO 8601, as kernels stamp messages
RUN_METADATA = {"execution", "ExecuteTime", "collapsed", "scrolled", "widgets"}


build = load_script(SRC / "build.py", "notebooks_build")


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def _source(cell: dict) -> str:
    return "".join(cell["source"])


def test_the_nine_tutorials_are_there():
    numbers = [p.name[:2] for p in NOTEBOOKS]
    assert numbers == ["00", "01", "02", "03", "04", "05", "06", "07", "08"], numbers


def test_each_notebook_has_its_script_and_each_script_its_notebook():
    assert [p.stem for p in SCRIPTS] == [p.stem for p in NOTEBOOKS]


def test_a_learner_opening_notebooks_sees_the_tutorials_and_a_readme_only():
    # JupyterLab opens on notebooks/: scripts and tooling live one folder down, in src/.
    # (JupyterLab hides dot files and __pycache__.)
    shown = {p.name for p in DIR.iterdir() if not p.name.startswith(".") and p.name != "__pycache__"}
    assert shown == {"README.md", "src", *(p.name for p in NOTEBOOKS)}, sorted(shown)
    assert (SRC / "build.py").exists() and (SRC / "sanitize.cfg").exists()


def test_one_kernelspec_name_in_every_notebook():
    specs = {json.loads(p.read_text())["metadata"]["kernelspec"]["name"] for p in NOTEBOOKS}
    assert specs == {"python3"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_cells_are_what_jupytext_reads_from_its_script(path):
    # The .py is the source of truth: a lesson edited there but not rebuilt (or edited in the
    # .ipynb only) fails here. Read with jupytext itself, not with build.py.
    script = jupytext.read(SRC / f"{path.stem}.py", fmt="py:percent")
    want = [(c.cell_type, c.source, dict(c.metadata)) for c in script.cells]
    have = [(c["cell_type"], _source(c), c["metadata"]) for c in _cells(path)]
    assert len(have) == len(want), f"{path.name}: {len(have)} cells, its script makes {len(want)}"
    for i, (w, h) in enumerate(zip(want, have)):
        assert h == w, f"{path.name} cell {i} differs from src/{path.stem}.py"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_timestamps_or_run_metadata_stored(path):
    # nbclient stamps every cell with execution times: each rebuild would be a diff of noise.
    text = path.read_text()
    stamps = TIMESTAMP.findall(text)
    assert not stamps, f"{path.name}: {len(stamps)} timestamps, the first {stamps[:1]}"
    nb = json.loads(text)
    assert nb["metadata"] == build.METADATA
    noisy = [(i, sorted(RUN_METADATA & c["metadata"].keys())) for i, c in enumerate(nb["cells"])
             if RUN_METADATA & c["metadata"].keys()]
    assert not noisy, f"{path.name}: run metadata in cells {noisy}"
    ids = [c["id"] for c in nb["cells"]]
    assert ids == [f"{path.name[:2]}-{i:02d}" for i in range(len(ids))], "cell ids not stable"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_as_canonical_json(path):
    # Equal notebooks are equal bytes, so only real changes show in a diff.
    text = path.read_text()
    assert text == build.dumps(nbformat.reads(text, as_version=4))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_checked_cells_have_a_stored_output_to_compare(path):
    # nbval skips the comparison of a cell whose stored outputs are empty: a checked cell
    # without them would pass whatever it printed.
    checked = [c for c in _cells(path) if c["cell_type"] == "code" and _source(c).startswith(CHECK)]
    assert checked, f"{path.name} checks no output"
    empty = [_source(c).splitlines()[1:2] for c in checked
             if not c["outputs"] or c["execution_count"] is None]
    assert not empty, f"{path.name}: checked cells without stored output: {empty}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_only_checked_cells_carry_outputs(path):
    # Timings, plots and widget states differ per run; committing them would be noise.
    stray = [_source(c)[:40] for c in _cells(path)
             if c["cell_type"] == "code" and c["outputs"] and not _source(c).startswith(CHECK)]
    assert not stray, f"{path.name}: outputs stored in unchecked cells: {stray}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_each_notebook_has_an_exercise_and_a_collapsed_solution(path):
    cells = _cells(path)
    exercises = [c for c in cells
                 if c["cell_type"] == "markdown" and re.search(r"^#+ .*exercise", _source(c), re.I | re.M)]
    hidden = [c for c in cells if c.get("metadata", {}).get("jupyter", {}).get("source_hidden")]
    assert exercises, f"{path.name} has no exercise heading"
    assert hidden, f"{path.name} has no collapsed solution cell"


SCRIPT = '''# %% [markdown]
# # A lesson

# %%
# %load_ext ampnb

# %% jupyter={"source_hidden": true} tags=["solution"]
# NBVAL_CHECK_OUTPUT
# %%amp bf16-mixed
x = 1
'''


def test_from_script_makes_stable_ids_one_kernelspec_and_real_magics(tmp_path):
    script = tmp_path / "07_lesson.py"
    script.write_text(SCRIPT)
    nb = build.from_script(script)
    assert [c.id for c in nb.cells] == ["07-00", "07-01", "07-02"]
    assert nb.metadata == build.METADATA
    assert nb.cells[1].source == "%load_ext ampnb"
    assert nb.cells[2].source == "# NBVAL_CHECK_OUTPUT\n%%amp bf16-mixed\nx = 1"
    assert nb.cells[2].metadata == {"jupyter": {"source_hidden": True}, "tags": ["solution"]}


def test_keep_checked_outputs_drops_everything_a_run_adds_but_checked_text(tmp_path):
    script = tmp_path / "07_lesson.py"
    script.write_text(SCRIPT + "\n# %%\nprint('timing')\n")
    source = build.from_script(script)
    ran = copy.deepcopy(source)
    ran.metadata["widgets"] = {"state": {}}
    ran.metadata["language_info"]["version"] = "3.x"
    for n, cell in enumerate(c for c in ran.cells if c.cell_type == "code"):
        cell.execution_count = n + 1
        cell.metadata["execution"] = {"iopub.status.idle": "2026-01-01T00:00:00.000000Z"}
        cell.outputs = [new_output("stream", name="stdout", text="a\n"),
                        new_output("stream", name="stdout", text="b\n"),
                        new_output("display_data", data={"text/plain": "<Figure>",
                                                         "image/png": "iVBOR"},
                                   metadata={"image/png": {"width": 10}})]
    kept = build.keep_checked_outputs(ran, source)
    unchecked, checked, timing = [c for c in kept.cells if c.cell_type == "code"]
    assert kept.metadata == build.METADATA
    assert all(c.metadata == s.metadata for c, s in zip(kept.cells, source.cells))
    assert (unchecked.outputs, unchecked.execution_count) == ([], None)
    assert (timing.outputs, timing.execution_count) == ([], None)
    assert checked.execution_count == 2
    assert [o.output_type for o in checked.outputs] == ["stream", "display_data"]
    assert checked.outputs[0].text == "a\nb\n"  # merged, as nbval merges before comparing
    assert checked.outputs[1].data == {"text/plain": "<Figure>"}
    assert checked.outputs[1].metadata == {}
    assert not TIMESTAMP.search(build.dumps(kept))


def test_a_tag_marks_a_cell_checked_too():
    assert build.is_checked(new_code_cell("x", metadata={"tags": [build.CHECK_TAG]}))
    assert not build.is_checked(new_code_cell("x  # NBVAL_CHECK_OUTPUT"))
