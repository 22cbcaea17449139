"""Every tutorial notebook in a real JupyterLab: it runs with no error, and its panel works."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from _env import ROOT
from _lab import executed_cells, open_notebook, run_all, shutdown_kernel
from _panels import PANEL_CHECKS, assert_no_errors

NOTEBOOKS = ROOT / "notebooks"
# The tutorial path; a notebook not written yet is skipped, later ones are found on disk.
TUTORIALS = ("00", "01", "02", "03", "04")
RUN_ALL_S = 240  # generous: the nbval budget is < 60 s a notebook, the browser adds rendering


def _numbers() -> list[str]:
    found = {m.group(1) for p in NOTEBOOKS.glob("*.ipynb") if (m := re.match(r"(\d\d)_", p.name))}
    return sorted(found | set(TUTORIALS))


def _notebook(number: str) -> Path | None:
    found = sorted(NOTEBOOKS.glob(f"{number}_*.ipynb"))
    return found[0] if found else None


@pytest.mark.parametrize("number", _numbers())
def test_tutorial_runs_and_its_panel_works(number: str, request: pytest.FixtureRequest) -> None:
    path = _notebook(number)
    if path is None:
        pytest.skip(f"notebooks/{number}_*.ipynb is not written yet")
    lab, page, artifacts = (request.getfixturevalue(f) for f in ("lab", "page", "artifacts"))
    # The notebook as it is now (the server's copy of notebooks/ was made at its start).
    shutil.copyfile(path, lab.root / path.name)
    open_notebook(page, lab.notebook_url(path.name))
    try:
        run_all(page, timeout_s=RUN_ALL_S)
        ran, code = executed_cells(page)
        assert_no_errors(page)
        assert ran == code, f"{path.name}: only {ran} of {code} code cells ran"
        if number in PANEL_CHECKS:
            name, check = PANEL_CHECKS[number]
            check(page, artifacts / f"{path.stem}.{name}.png")
            assert_no_errors(page)  # nothing the clicks did raised, in a cell or in the panel
    finally:
        shutdown_kernel(page)
