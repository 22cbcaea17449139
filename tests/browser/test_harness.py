"""The harness itself, on scratch notebooks: it runs cells, sees widgets, and catches errors."""

from __future__ import annotations

import pytest
from _env import SHOTS, missing, skip_or_fail
from _lab import (
    errors,
    executed_cells,
    open_notebook,
    run_all,
    shutdown_kernel,
    wait_for_error,
    widget_button,
    write_notebook,
)

SCRATCH_OK = [
    "#md A scratch notebook the browser harness writes for itself.",
    "x = 6 * 7\nprint('answer', x)",
    "import ipywidgets as widgets\n"
    "s = widgets.IntSlider(value=3, description='ok')\n"
    "b = widgets.Button(description='Add')\n"
    "out = widgets.Label(value='clicks 0')\n"
    "def on_click(_):\n"
    "    out.value = f'clicks {int(out.value.split()[1]) + 1}'\n"
    "b.on_click(on_click)\n"
    "widgets.VBox([s, b, out])",
]
SCRATCH_ERROR = ["print('before')", "1 / 0", "print('never runs')"]
SCRATCH_WIDGET_ERROR = [
    "import ipywidgets as widgets\nfrom IPython import get_ipython\n"
    "out = widgets.Output()\nb = widgets.Button(description='Boom')\n"
    "def boom(_):\n    with out:\n        try:\n            1 / 0\n"
    "        except ZeroDivisionError:\n            get_ipython().showtraceback()\n"
    "b.on_click(boom)\n"
    # How ampnb's panels show an exception from a callback: an HTML message, .ampnb-error.
    "msg = widgets.HTML()\nq = widgets.Button(description='Oops')\n"
    "def oops(_):\n    msg.value = '<div class=\"ampnb-error\">ValueError: bad mode</div>'\n"
    "q.on_click(oops)\nwidgets.VBox([b, out, q, msg])",
]


def test_scratch_notebook_runs_widgets_work_and_no_errors(lab, page, artifacts):
    write_notebook(lab.root / "_scratch_ok.ipynb", SCRATCH_OK)
    open_notebook(page, lab.notebook_url("_scratch_ok.ipynb"))
    run_all(page)
    assert executed_cells(page) == (2, 2)
    assert "answer 42" in page.locator(".jp-OutputArea-output").first.inner_text()
    assert errors(page) == []
    label = page.locator(".widget-label", has_text="clicks")
    assert label.inner_text() == "clicks 0"
    widget_button(page, "Add").click()
    page.wait_for_function("() => [...document.querySelectorAll('.widget-label')]"
                           ".some(e => e.textContent === 'clicks 1')", timeout=10_000)
    page.screenshot(path=str(artifacts / "_scratch_ok.png"))
    SHOTS.append(artifacts / "_scratch_ok.png")
    shutdown_kernel(page)


def test_harness_reports_cell_errors_and_errors_shown_inside_widgets(lab, page):
    # One notebook for both (a kernel start is the slow part): the widget cell runs first,
    # then execution stops at the cell error, as in JupyterLab.
    write_notebook(lab.root / "_scratch_errors.ipynb", SCRATCH_WIDGET_ERROR + SCRATCH_ERROR)
    open_notebook(page, lab.notebook_url("_scratch_errors.ipynb"))
    run_all(page)
    found = errors(page)
    # Found twice: in the notebook model, and as the traceback rendered on screen.
    assert "cell 2: ZeroDivisionError: division by zero" in found, found
    assert len(found) == 2 and "----> 1 1 / 0" in found[1], found
    assert executed_cells(page) == (3, 4)
    widget_button(page, "Boom").click()
    # The cells' source names ZeroDivisionError too, so wait on the errors the harness reads.
    found = wait_for_error(page, "in boom(_)")
    assert len(found) == 3 and found[2].startswith("stderr traceback"), found
    assert "division by zero" in found[2], found
    widget_button(page, "Oops").click()
    found = wait_for_error(page, "bad mode")
    assert "panel error: ValueError: bad mode" in found, found
    shutdown_kernel(page)


def test_a_machine_without_chromium_skips_unless_the_browser_is_required(monkeypatch):
    monkeypatch.setattr("shutil.which", lambda _name: None)
    reason = missing()
    assert reason == "no chromium executable found"
    monkeypatch.delenv("AMPNB_REQUIRE_BROWSER", raising=False)
    with pytest.raises(pytest.skip.Exception, match="apt-get install chromium"):
        skip_or_fail(reason)
    monkeypatch.setenv("AMPNB_REQUIRE_BROWSER", "1")
    with pytest.raises(pytest.fail.Exception, match="no chromium executable found"):
        skip_or_fail(reason)
