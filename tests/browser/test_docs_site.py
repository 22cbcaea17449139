"""The built docs site in Chromium with the network off: every panel is drawn from its saved
widget state by the widget manager that ships with the site, its controls respond, and no output
is wider than its column at 1280 px.

The site is `make docs`'s build/docs (CI builds it before `make test`). Without a current one
the test is skipped, unless AMPNB_REQUIRE_BROWSER=1 (CI) or AMPNB_BUILD_DOCS_SITE=1: then it
builds the tutorials that show panels into a temporary folder first (several minutes on 2
cores). AMPNB_DOCS_SITE=PATH names another built site.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _env import ROOT

PlaywrightTimeout = pytest.importorskip("playwright.sync_api").TimeoutError

SITE = ROOT / "build" / "docs"
VIEWPORT = {"width": 1280, "height": 900}
RENDER_MS = 30_000
VIEW = "application/vnd.jupyter.widget-view+json"
STATE = "application/vnd.jupyter.widget-state+json"


def _check_site():
    spec = importlib.util.spec_from_file_location("check_site", ROOT / "docs" / "check_site.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _panel_notebooks() -> list[str]:
    """The tutorials whose scripts show a panel (the rule docs/check_site.py uses)."""
    panels = _check_site().PANELS
    return sorted(p.stem for p in (ROOT / "notebooks" / "src").glob("[0-9][0-9]_*.py")
                  if panels.search(p.read_text()))


def _sources() -> list[Path]:
    """What a built site depends on besides the package: a site older than any is stale."""
    found = [*(ROOT / "docs").rglob("*"), *(ROOT / "notebooks").glob("*.ipynb")]
    return [p for p in found if "__pycache__" not in p.parts]  # importing check_site writes one


def _current(site: Path) -> bool:
    index = site / "docs" / "index.html"
    if not index.exists():
        return False
    return all(p.stat().st_mtime <= index.stat().st_mtime for p in _sources() if p.is_file())


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if os.environ.get("AMPNB_DOCS_SITE"):
        return Path(os.environ["AMPNB_DOCS_SITE"])
    if _current(SITE):
        return SITE
    if "1" not in (os.environ.get("AMPNB_REQUIRE_BROWSER"), os.environ.get("AMPNB_BUILD_DOCS_SITE")):
        pytest.skip("no current docs site in build/docs: run `make docs` first (CI does), or set "
                    "AMPNB_BUILD_DOCS_SITE=1 to build the pages with panels here")
    out = tmp_path_factory.mktemp("site")
    pages = ",".join(["docs/*.md", *(f"notebooks/{n}.ipynb" for n in _panel_notebooks())])
    done = subprocess.run(
        [sys.executable, "-m", "sphinx", "-q", "-b", "html", "-c", "docs",
         "-D", f"include_patterns={pages}", str(ROOT), str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=1200, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _panel_pages(site: Path) -> list[Path]:
    return sorted(p for p in (site / "notebooks").glob("*.html") if VIEW in p.read_text())


def _offline_page(browser: object, blocked: list[str]) -> object:
    """A page that can read files only: the network is off and any other request is refused."""
    context = browser.new_context(viewport=VIEWPORT, offline=True)

    def only_files(route: object) -> None:
        if route.request.url.startswith("file:"):
            route.continue_()
        else:
            blocked.append(route.request.url)
            route.abort()

    context.route("**/*", only_files)
    return context.new_page()


def _shown_classes(html: str) -> set[str]:
    """The ampnb CSS classes of every widget reachable from a displayed view in the saved state."""
    (state,) = re.findall(rf'<script type="{re.escape(STATE)}">(.*?)</script>', html, re.S)
    models = json.loads(state)["state"]
    views = [json.loads(v)["model_id"]
             for v in re.findall(rf'<script type="{re.escape(VIEW)}">(.*?)</script>', html, re.S)]
    seen, todo, classes = set(), list(views), set()
    while todo:
        mid = todo.pop()
        if mid in seen or mid not in models:
            continue
        seen.add(mid)
        s = models[mid]["state"]
        layout = models.get(str(s.get("layout", "")).removeprefix("IPY_MODEL_"), {}).get("state", {})
        if layout.get("display") == "none" or layout.get("visibility") == "hidden":
            continue
        classes |= {c for c in s.get("_dom_classes", []) if c.startswith("ampnb-")}
        todo += [c.removeprefix("IPY_MODEL_") for c in s.get("children", [])
                 if isinstance(c, str)]
    return classes


# How far each output reaches past what holds it: > 0 means wider than its column (or clipped).
OVERFLOW_JS = """() => {
  const article = document.querySelector('.bd-article, div.body, main') || document.body;
  const edge = article.getBoundingClientRect().right;
  const found = [];
  const wide = ['.cell_output', '.cell_input', 'pre', 'table', 'img', '.widget-subarea'];
  for (const el of article.querySelectorAll(wide.join(','))) {
    const right = el.getBoundingClientRect().right;
    let holder = el.parentElement, scrolls = false;
    for (; holder && holder !== article; holder = holder.parentElement) {
      const ox = getComputedStyle(holder).overflowX;
      if (ox !== 'visible') { scrolls = ox === 'auto' || ox === 'scroll'; break; }
    }
    const limit = holder && holder !== article ? holder.getBoundingClientRect().right : edge;
    if (!scrolls && right > limit + 1)
      found.push(`${el.tagName.toLowerCase()}.${el.className} by ${Math.round(right - limit)} px`);
  }
  const page = document.scrollingElement.scrollWidth - window.innerWidth;
  if (page > 1) found.push(`the page itself scrolls sideways by ${page} px`);
  return found;
}"""


def test_each_panel_is_drawn_offline_and_its_controls_respond(site, browser, artifacts):
    pages = _panel_pages(site)
    expected = {f"{n}.html" for n in _panel_notebooks()} & {p.name for p in
                                                            (site / "notebooks").glob("*.html")}
    assert expected and {p.name for p in pages} >= expected, (expected, pages)
    for path in pages:
        blocked: list[str] = []
        page = _offline_page(browser, blocked)
        crashed: list[str] = []
        page.on("pageerror", lambda err, crashed=crashed: crashed.append(str(err)))
        page.goto(path.as_uri())
        html = path.read_text()
        views = html.count(f'<script type="{VIEW}">')
        try:
            page.wait_for_function(
                "n => document.querySelectorAll('.widget-subarea > .jupyter-widgets').length >= n",
                arg=views, timeout=RENDER_MS)
        except PlaywrightTimeout:
            pytest.fail(f"{path.name}: its {views} widget views were not drawn offline in "
                        f"{RENDER_MS // 1000} s (the widget manager did not load: {blocked})")
        classes = _shown_classes(html)
        assert any(c.endswith("-panel") or c.count("-") >= 2 for c in classes), (path.name, classes)
        for css in sorted(classes):  # an empty message box is drawn with no height
            box = page.locator(f".{css}").first.bounding_box()
            assert box and box["width"] > 0, f"{path.name}: .{css} not drawn"
        controls = page.locator(".widget-subarea :is(select, button, input)").all()
        assert controls, f"{path.name}: no control drawn"
        for control in controls:
            box = control.bounding_box()
            assert box and box["width"] > 0 and box["height"] > 0, (
                f"{path.name}: a {control.evaluate('e => e.outerHTML.slice(0, 120)')} has no size")
        _operate(page, path.name)
        page.screenshot(path=str(artifacts / f"docs_{path.stem}.png"), full_page=False)
        assert not blocked, f"{path.name} asked the network for {blocked}"
        assert not crashed, f"{path.name}: {crashed}"
        page.context.close()


def _operate(page: object, name: str) -> None:
    """Move every kind of control the panels on the page have: they respond without a kernel."""
    moved = 0
    for select in page.locator(".widget-subarea .widget-dropdown select:enabled").all():
        options = select.evaluate("s => [...s.options].map(o => o.value)")
        if len(options) > 1:
            before = select.input_value()
            other = next(o for o in options if o != before)
            select.select_option(other)
            assert select.input_value() == other, f"{name}: a dropdown did not take {other!r}"
            moved += 1
    for group in page.locator(".widget-subarea .widget-toggle-buttons").all():
        idle = group.locator("button:enabled:not(.mod-active)")
        if idle.count():
            idle.first.click()
            assert "mod-active" in idle.first.get_attribute("class") or group.locator(
                "button.mod-active").count() == 1, f"{name}: a toggle button did not switch"
            moved += 1
    for handle in page.locator(".widget-subarea .widget-slider .noUi-handle").all():
        readout = handle.locator("xpath=ancestor::div[contains(@class,'widget-slider')]"
                                 "//div[contains(@class,'widget-readout')]").first
        before = readout.inner_text()
        handle.focus()
        page.keyboard.press("ArrowRight")
        assert readout.inner_text() != before, f"{name}: the slider did not move"
        moved += 1
    assert moved, f"{name}: no control on the page could be operated"


def test_no_output_is_wider_than_its_column_at_1280_px(site, browser):
    pages = sorted((site / "notebooks").glob("*.html")) + sorted((site / "docs").glob("*.html"))
    assert pages
    found = {}
    for path in pages:
        page = _offline_page(browser, [])
        page.goto(path.as_uri())
        if VIEW in path.read_text():  # measured with the panels drawn (the test above needs them)
            with contextlib.suppress(PlaywrightTimeout):
                page.wait_for_selector(".widget-subarea > .jupyter-widgets", timeout=RENDER_MS)
        problems = page.evaluate(OVERFLOW_JS)
        if problems:
            found[path.name] = problems[:5]
        page.context.close()
    assert not found, found
