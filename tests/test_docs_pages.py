"""The README is short and points at the docs site, where the reference lives: every page it links
exists, every page is on the site's index, and every ampnb name the pages use exists."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
MAX_README_LINES = 300  # issue #43: a README of at most 300 lines

LINK = re.compile(r"\]\(([^)\s]+)\)")  # a Markdown link's target
TOCTREE = re.compile(r"^```\{toctree\}\n(.*?)^```", re.S | re.M)
NAME = re.compile(r"(?<![\w./-])ampnb(?:\.[A-Za-z_]\w*)+")  # ampnb.x.y, not a path or a URL
FROM_IMPORT = re.compile(r"^\s*from (ampnb(?:\.\w+)*) import ([\w, ]+)", re.M)


def links(page: Path) -> list[str]:
    """The page's relative link targets (no web addresses, no anchors within the page)."""
    return [t.split("#")[0] for t in LINK.findall(page.read_text())
            if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def toctree_entries() -> set[str]:
    """The pages docs/index.md lists in its toctrees, as docs-relative names without suffix."""
    found = set()
    for block in TOCTREE.findall((DOCS / "index.md").read_text()):
        found |= {ln.strip() for ln in block.splitlines() if ln.strip() and not ln.startswith(":")}
    return found


def resolves(dotted: str) -> bool:
    """Whether `ampnb.a.b.c` names something: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def names(text: str) -> set[str]:
    """Every ampnb name the text uses: dotted names, and what `from ampnb... import` takes."""
    found = set(NAME.findall(text))
    for module, imported in FROM_IMPORT.findall(text):
        found |= {f"{module}.{n.strip()}" for n in imported.split(",") if n.strip()}
    return found


def test_the_readme_is_at_most_300_lines():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; at most {MAX_README_LINES}"


def test_every_relative_link_in_the_readme_exists():
    missing = [t for t in links(README) if not (ROOT / t).exists()]
    assert not missing, f"README.md links to files that are not there: {missing}"


def test_the_readme_links_every_docs_page():
    linked = {(ROOT / t).resolve() for t in links(README)}
    unlinked = [p.name for p in PAGES if p.name != "index.md" and p.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def test_every_docs_page_is_on_the_sites_index():
    listed = toctree_entries()
    missing = [p.stem for p in PAGES if p.name != "index.md" and p.stem not in listed]
    assert not missing, f"docs pages in no toctree of docs/index.md: {missing}"
    absent = [e for e in listed if not e.startswith("/") and not (DOCS / f"{e}.md").exists()]
    assert not absent, f"toctree entries with no page: {absent}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_between_docs_pages_exists(page):
    missing = [t for t in links(page) if not (page.parent / t).exists()]
    assert not missing, f"{page.name} links to files that are not there: {missing}"


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: p.name)
def test_every_ampnb_name_a_page_uses_exists(page):
    used = names(page.read_text())
    missing = sorted(n for n in used if not resolves(n))
    assert not missing, f"{page.name} names what ampnb does not have: {missing}"


def test_the_name_check_sees_what_it_should():
    text = ("`ampnb.get_format(x)` and `ampnb/diagnosis/core.py`, pip install \"ampnb[watch]\";\n"
            "from ampnb.watchlog import read_log, StepRecord\n`ampnb.no_such_thing`\n")
    assert names(text) == {"ampnb.get_format", "ampnb.watchlog", "ampnb.watchlog.read_log",
                           "ampnb.watchlog.StepRecord", "ampnb.no_such_thing"}
    assert [n for n in sorted(names(text)) if not resolves(n)] == ["ampnb.no_such_thing"]
