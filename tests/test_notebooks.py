"""The tutorials as files: one kernel, checked outputs really stored, exercises with solutions."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("[0-9][0-9]_*.ipynb"))
CHECK = "# NBVAL_CHECK_OUTPUT"


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def _source(cell: dict) -> str:
    return "".join(cell["source"])


def test_the_five_tutorials_are_there():
    numbers = [p.name[:2] for p in NOTEBOOKS]
    assert numbers == ["00", "01", "02", "03", "04"], numbers


def test_one_kernelspec_name_in_every_notebook():
    specs = {json.loads(p.read_text())["metadata"]["kernelspec"]["name"] for p in NOTEBOOKS}
    assert specs == {"python3"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_checked_cells_have_a_stored_output_to_compare(path):
    # nbval skips the comparison of a cell whose stored outputs are empty: a checked cell
    # without them would pass whatever it printed.
    checked = [c for c in _cells(path) if c["cell_type"] == "code" and _source(c).startswith(CHECK)]
    assert checked, f"{path.name} checks no output"
    empty = [_source(c).splitlines()[1:2] for c in checked if not c["outputs"]]
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
