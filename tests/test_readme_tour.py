"""The README's five-cell tour runs as a learner types it: in IPython, in order, without an error,
and each cell shows what the README says it shows; torch's state is as before afterwards."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _magics_kit import shown
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

from ampnb import putback_state
from ampnb.modes import MODES

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def tour_cells() -> list[str]:
    """The python blocks of the README's "A five-cell tour" section, in order."""
    section = README.split("## A five-cell tour", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```python\n(.*?)^```", section, re.S | re.M)


def test_the_tour_has_five_cells():
    assert len(tour_cells()) == 5


def test_the_tour_runs_and_each_cell_shows_what_it_says():
    pytest.importorskip("ipywidgets")
    from ampnb.panels import PrecisionPanel

    shell = InteractiveShell.instance()
    before, names = putback_state.torch_state(), set(shell.user_ns)
    results, outputs = [], []
    try:
        for i, cell in enumerate(tour_cells()):
            with capture_output() as out:
                result = shell.run_cell(cell, store_history=False)
            assert result.success, f"tour cell {i + 1} failed: {result.error_in_exec!r}\n{cell}"
            results.append(result.result)
            outputs.append(shown(out))
        ns = shell.user_ns
        compare = outputs[1]
        assert all(re.search(rf"^{re.escape(m)}\s", compare, re.M)
                   for m in ("32-true", "16-mixed", "bf16-mixed")), compare
        assert isinstance(results[2], PrecisionPanel)
        assert results[3] is ns["report"].recommended and results[3].mode in MODES
        assert len(ns["w"].records) == len(ns["batches"])  # one record per optimizer step
        assert str(results[4]).startswith(f"watched steps: {len(ns['batches'])} steps")
    finally:
        shell.run_line_magic("unload_ext", "ampnb")
        for name in set(shell.user_ns) - names:
            shell.user_ns.pop(name, None)
    assert putback_state.torch_state() == before
