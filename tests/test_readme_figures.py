"""What the README and the docs pages say is true: their measured figures come from the results
file or a checked output, and their examples with shown outputs run and give them.

A measured figure is a number with a unit of time, size or ratio in a page's prose and tables
(code blocks are examples, checked below). Each must be a number that
`benchmarks/RESULTS.md` (written by `make bench`) or a checked notebook output holds, or one of
the few specification figures listed here with their source.
"""

from __future__ import annotations

import doctest
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# The README and every page of the docs site (the reference moved there from the README).
PAGES = (README, *sorted((ROOT / "docs").glob("*.md")))
RESULTS = ROOT / "benchmarks" / "RESULTS.md"

# Figures that are specifications, not measurements: the text says whose.
SPECIFIED = {
    "2 GB": "Binder's memory limit (mybinder.org's documented user limit)",
    "3 GB": "Lightning's docs on bitsandbytes, quoted with their source in the text",
}

UNIT = r"(?:×(?!\s?\d)|x\b|%|ms\b|µs\b|s\b|KiB\b|MiB\b|GiB\b|GB\b|MB\b)"
NUM = r"\d+(?:\.\d+)?"
FIGURE = re.compile(rf"(?<![\w.\-/+]){NUM}(?:\s?[–-]\s?{NUM})?\s?{UNIT}")
NUMBER = re.compile(NUM)


def prose(text: str) -> str:
    """A page without its fenced code blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def figures(text: str) -> list[str]:
    """Every measured-looking figure in the text, as written."""
    return [m.group(0) for m in FIGURE.finditer(prose(text))]


def checked_outputs() -> str:
    """The text of every notebook output that nbval compares."""
    found = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "code" and "NBVAL_CHECK_OUTPUT" in "".join(cell["source"]):
                for out in cell.get("outputs", []):
                    found.append("".join(out.get("text", "")))
                    found.extend("".join(v) for k, v in out.get("data", {}).items()
                                 if k.startswith("text/"))
    return "\n".join(found)


def _values(text: str) -> set[float]:
    return {float(n) for n in NUMBER.findall(text.replace(",", ""))}


def unsourced(readme: str, sources: str) -> list[str]:
    """The README's figures whose numbers no source holds (specification figures aside)."""
    known = _values(sources)
    return [f for f in figures(readme)
            if not any(f.replace(" ", "") == s.replace(" ", "") for s in SPECIFIED)
            and not all(float(n) in known for n in NUMBER.findall(f))]


def test_the_figure_check_sees_what_it_should():
    text = ("A step took 1.27× (`x = 3`), 7–100× slower; 256×512 is a shape; 2.5e+04x;\n"
            "```python\nspeed = 9.9  # 9.9× in a code block\n```\n45 ms and 2 GB.\n")
    assert figures(text) == ["1.27×", "7–100×", "45 ms", "2 GB"]
    assert unsourced(text, "| 1.27 | 45.0 ms | 100 |") == ["7–100×"]


def notebook_prose() -> dict[str, str]:
    """The notebooks' own words: their README and every markdown cell."""
    found = {"notebooks/README.md": (ROOT / "notebooks" / "README.md").read_text()}
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        found[f"notebooks/{path.name}"] = "\n".join("".join(c["source"]) for c in cells
                                                    if c["cell_type"] == "markdown")
    return found


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_figure_in_the_readme_and_docs_comes_from_results_or_a_checked_output(page):
    sources = RESULTS.read_text() + checked_outputs()
    missing = unsourced(page.read_text(), sources)
    assert not missing, (f"{_name(page)}: figures found in neither benchmarks/RESULTS.md "
                         f"(make bench) nor a checked notebook output: {missing}")


@pytest.mark.parametrize("name", sorted(notebook_prose()))
def test_every_figure_in_the_notebooks_prose_comes_from_results_or_a_checked_output(name):
    sources = RESULTS.read_text() + checked_outputs()
    missing = unsourced(notebook_prose()[name], sources)
    assert not missing, f"{name}: figures with no source (make bench, a checked output): {missing}"


class _Sanitized(doctest.OutputChecker):
    """Shown outputs compared as nbval compares the notebooks: machine-dependent times out."""

    TIMES = re.compile(r"\d+(?:\.\d+)?\s?(?:ms|µs|s)\b")

    def check_output(self, want: str, got: str, optionflags: int) -> bool:
        return super().check_output(self.TIMES.sub("T", want), self.TIMES.sub("T", got),
                                    optionflags)


def pycon_blocks(page: Path) -> list[str]:
    """The page's examples shown with their output (```pycon blocks)."""
    return re.findall(r"^```pycon\n(.*?)^```", page.read_text(), re.S | re.M)


def test_the_readme_shows_examples_with_outputs():
    assert pycon_blocks(README), "the README shows no example with its output"


@pytest.mark.parametrize("page", [p for p in PAGES if pycon_blocks(p)], ids=_name)
def test_the_examples_with_outputs_give_them(page):
    parser = doctest.DocTestParser()
    runner = doctest.DocTestRunner(checker=_Sanitized(), optionflags=doctest.ELLIPSIS)
    globs: dict = {}  # one namespace per page, as a reader runs its blocks in order
    for i, block in enumerate(pycon_blocks(page)):
        runner.run(parser.get_doctest(block, globs, f"{_name(page)} pycon block {i}", str(page), 0))
    result = runner.summarize(verbose=False)
    assert result.failed == 0 and result.attempted > 0


@pytest.mark.parametrize("figure", sorted(SPECIFIED))
def test_specification_figures_are_still_in_the_readme_or_docs(figure):
    assert any(figure in prose(p.read_text()) for p in PAGES), \
        f"{figure} is no longer used; drop it from SPECIFIED"
