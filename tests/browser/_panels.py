"""What each ampnb panel must do in a real browser: click it as a learner would, read the page."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path

from _env import SHOTS
from _lab import errors, widget_button

RENDER_MS = 60_000  # a panel's first render can wait behind a busy 2-core machine
ACTION_MS = 60_000  # one training step on CPU; fp16 there is a slow fallback
PREFERRED_MODES = ("bf16-mixed", "16-mixed", "bf16-true", "64-true")


def _wait_changed(page: object, selector: str, before: str, attr: str = "innerText") -> str:
    """Wait until the first element matching selector has another `attr` than before."""
    page.wait_for_function(
        f"""() => {{ const el = document.querySelector({json.dumps(selector)});
                    return el && el.{attr} !== {json.dumps(before)}; }}""",
        timeout=ACTION_MS, polling=200)
    return page.locator(selector).first.evaluate(f"el => el.{attr}")


def _wait_text(page: object, selector: str, pattern: str) -> str:
    """Wait until the first element matching selector has text matching a JS regex."""
    page.wait_for_function(
        f"""() => {{ const el = document.querySelector({json.dumps(selector)});
                    return el && new RegExp({json.dumps(pattern)}, 'm').test(el.innerText); }}""",
        timeout=ACTION_MS, polling=200)
    return page.locator(selector).first.inner_text()


def _field(text: str, name: str) -> str:
    """The value after `name ` on its own line of a status text ("scale 1024 (2^10)")."""
    found = re.search(rf"^{re.escape(name)} (.+)$", text, re.M)
    assert found, f"no {name!r} line in the status:\n{text}"
    return found.group(1).strip()


def _scale(text: str) -> float:
    """A scale as the panel prints it: '1024 (2^10)' exactly, else the %g number."""
    power = re.search(r"\(2\^(-?\d+)\)", text)
    return 2.0 ** int(power.group(1)) if power else float(text.split()[0])


def _plot_html(page: object, selector: str) -> str:
    """The rendered figure inside a plot Output (an <img> data URL, or inline SVG)."""
    selector = f"{selector} img, {selector} svg"
    page.wait_for_selector(selector, timeout=RENDER_MS)
    return page.locator(selector).first.evaluate("el => el.outerHTML")


def _screenshot(page: object, selector: str, shot: Path) -> None:
    """A picture of the whole cell output that holds the panel."""
    cell = page.locator(selector).first.locator(
        "xpath=ancestor::div[contains(concat(' ', @class, ' '), ' jp-Cell-outputArea ')]")
    # The notebook scrolls inside its own panel, which clips a tall element: make the window
    # tall enough for the whole output first.
    viewport = page.viewport_size
    height = cell.evaluate("el => el.getBoundingClientRect().height")
    page.set_viewport_size({"width": viewport["width"],
                            "height": min(6000, max(viewport["height"], int(height) + 300))})
    try:
        # The picture is evidence, not a check: taken by the page where the output lies now.
        # (Playwright's element screenshot first waits for the element to stop moving, which
        # a live panel on a loaded machine may not do within its timeout.)
        cell.evaluate("el => el.scrollIntoView({block: 'start'})")
        page.screenshot(path=str(shot), clip=cell.bounding_box(), animations="disabled")
    finally:
        page.set_viewport_size(viewport)
    SHOTS.append(shot)


def check_precision_panel(page: object, shot: Path) -> None:
    """Choose another mode, press Step: the status and the loss curve show the new step."""
    root = ".ampnb-precision-panel"
    status, plot = f"{root} .ampnb-precision-status", f"{root} .ampnb-precision-plot"
    page.wait_for_selector(status, timeout=RENDER_MS)
    select = page.locator(f"{root} .ampnb-precision-mode select").first
    current = select.evaluate("s => s.options[s.selectedIndex].textContent")
    labels = select.evaluate("s => [...s.options].map(o => o.textContent)")
    usable = [m for m in PREFERRED_MODES if m in labels and m != current]
    assert usable, f"no other available mode to choose among {labels} (current {current})"
    before_plot = _plot_html(page, plot)
    select.select_option(label=usable[0])
    switched = _wait_text(page, status, rf"^mode {re.escape(usable[0])} on ")
    steps = int(re.match(r"\d+", _field(switched, "steps")).group())
    widget_button(page.locator(root).first, "Step").click()
    after = _wait_text(page, status, rf"^steps {steps + 1}, last loss ")
    assert f"mode {usable[0]} on" in after
    loss = float(_field(after, "steps").split("last loss ")[1])
    assert math.isfinite(loss), after
    assert _field(after, "steps") != _field(switched, "steps")
    # Measured for this step (it read "n/a" or the previous step's time before).
    assert re.fullmatch(r"\d+(\.\d+)? ms", _field(after, "step time")), after
    assert _wait_changed(page, f"{plot} img, {plot} svg", before_plot, "outerHTML") != before_plot
    _screenshot(page, root, shot)


def check_scaler_panel(page: object, shot: Path) -> None:
    """Inject inf, then Next step: the status shows a skipped step and the backed-off scale."""
    root = ".ampnb-scaler-panel"
    status, plot = f"{root} .ampnb-scaler-status", f"{root} .ampnb-scaler-plot"
    panel = page.locator(root).first
    page.wait_for_selector(status, timeout=RENDER_MS)
    backoff = float(panel.locator(".widget-text").filter(
        has=page.locator("label", has_text=re.compile(r"^backoff_factor$"))
    ).locator("input").input_value())
    before = panel.locator(".ampnb-scaler-status").inner_text()
    skipped, done = map(int, _field(before, "steps skipped").split("/"))
    before_plot = _plot_html(page, plot)
    widget_button(panel, "Inject inf").click()
    _wait_text(page, status, "armed: ")
    widget_button(panel, "Next step").click()
    after = _wait_text(page, status, rf"^steps skipped {skipped + 1}/{done + 1}$")
    assert _field(after, "skipped") == "True", after
    assert _field(after, "found_inf") == "True", after
    assert _scale(_field(after, "scale")) == _scale(_field(before, "scale")) * backoff, (before,
                                                                                      after)
    assert _wait_changed(page, f"{plot} img, {plot} svg", before_plot, "outerHTML") != before_plot
    _screenshot(page, root, shot)


def check_range_explorer(page: object, shot: Path) -> None:
    """The range plot appears, and changes when another layer is chosen."""
    plot = ".ampnb-range-plot"
    select = page.locator(".ampnb-range-layer select").first
    select.wait_for(timeout=RENDER_MS)
    before = _plot_html(page, plot)
    labels = select.evaluate("s => [...s.options].map(o => o.textContent)")
    current = select.evaluate("s => s.options[s.selectedIndex].textContent")
    others = [label for label in labels if label != current]
    assert others, f"the layer dropdown offers nothing but {current!r}"
    select.select_option(label=others[0])
    assert _wait_changed(page, f"{plot} img, {plot} svg", before, "outerHTML") != before
    _screenshot(page, plot, shot)


# notebook number -> (panel name for the screenshot, check) for the tutorials that have one
PANEL_CHECKS: dict[str, tuple[str, Callable[[object, Path], None]]] = {
    "00": ("precision_panel", check_precision_panel),
    "01": ("range_explorer", check_range_explorer),
    "03": ("scaler_panel", check_scaler_panel),
}


def assert_no_errors(page: object) -> None:
    """Fail with every error the page shows."""
    found = errors(page)
    assert found == [], "\n".join(found)
