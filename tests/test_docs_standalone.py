"""The repository's docs stand on their own: nothing sends a reader outside the repository
(to a development workspace's shared folder), and CONTRIBUTING's links resolve in it."""

from __future__ import annotations

import re
import runpy
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = re.compile(r"\.\./shared\b|\bshared/(?:DESIGN|STYLE|FACTS)\.md")
WORKSPACE_FILES = re.compile(r"\b(?:DESIGN|STYLE|FACTS)\.md\b")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
    return [ROOT / p for p in out if (ROOT / p).is_file()]


def _docs() -> list[Path]:
    """What a reader reads: every Markdown file and notebook in the repository."""
    return [p for p in _tracked() if p.suffix in (".md", ".ipynb") and "tests" not in p.parts]


def test_no_tracked_file_points_outside_the_repository():
    found = [f"{p.relative_to(ROOT)}:{n}" for p in _tracked()
             if p.suffix in (".md", ".py", ".ipynb", ".txt", ".cfg", ".toml", "")
             for n, line in enumerate(p.read_text("utf-8", "replace").splitlines(), 1)
             if OUTSIDE.search(line)]
    assert not found, f"these send the reader outside the repository: {found}"


def test_the_docs_name_no_workspace_design_files():
    found = [f"{p.relative_to(ROOT)}:{n}" for p in _docs()
             for n, line in enumerate(p.read_text("utf-8").splitlines(), 1)
             if WORKSPACE_FILES.search(line)]
    assert not found, f"DESIGN/STYLE/FACTS.md are not in the repository (docs/design.md is): {found}"


def test_contributing_starts_from_the_design_in_the_repository():
    text = (ROOT / "CONTRIBUTING.md").read_text()
    first = text.split("\n\n")[1]
    assert "docs/design.md" in first
    for target in LINK.findall(text):
        if "://" not in target:
            assert (ROOT / target).exists(), f"CONTRIBUTING links {target}, which is not there"


def test_the_design_page_is_on_the_site():
    index = (ROOT / "docs" / "index.md").read_text()
    assert re.search(r"^design$", index, re.M), "docs/index.md's toctree lists no design page"


def test_the_site_says_how_to_install_and_start_and_its_footer_reads():
    index = (ROOT / "docs" / "index.md").read_text()
    assert re.search(r"^start$", index, re.M), "docs/index.md's toctree lists no start page"
    start = (ROOT / "docs" / "start.md").read_text()
    for command in ("pip install", "make lab", "make binder-url", "%load_ext ampnb"):
        assert command in start, command
    conf = runpy.run_path(str(ROOT / "docs" / "conf.py"))
    assert conf["copyright"].strip(), "an empty copyright makes the footer read '©. |'"
    assert not any("://" in src for src in conf["nb_ipywidgets_js"]), "widget manager from a CDN"
    assert (ROOT / "docs" / "_static" / next(iter(conf["nb_ipywidgets_js"]))).exists()
