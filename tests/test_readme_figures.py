"""What the README says is true: its measured figures come from the results file or a checked
output, and its examples with shown outputs run and give them.

A measured figure is a number with a unit of time, size or ratio in the README's prose and
tables (code blocks are examples, checked below). Each must be a number that
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
    """The README without its fenced code blocks."""
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


def test_every_figure_in_the_readme_comes_from_results_or_a_checked_output():
    sources = RESULTS.read_text() + checked_outputs()
    missing = unsourced(README.read_text(), sources)
    assert not missing, (f"README figures found in neither benchmarks/RESULTS.md (make bench) "
                         f"nor a checked notebook output: {missing}")


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


def test_the_readme_examples_with_outputs_give_them():
    parser = doctest.DocTestParser()
    examples = [b for b in re.findall(r"^```pycon\n(.*?)^```", README.read_text(), re.S | re.M)]
    assert examples, "the README shows no example with its output"
    runner = doctest.DocTestRunner(checker=_Sanitized(), optionflags=doctest.ELLIPSIS)
    globs: dict = {}
    for i, block in enumerate(examples):
        runner.run(parser.get_doctest(block, globs, f"README pycon block {i}", str(README), 0))
    result = runner.summarize(verbose=False)
    assert result.failed == 0 and result.attempted > 0


@pytest.mark.parametrize("figure", sorted(SPECIFIED))
def test_specification_figures_are_still_in_the_readme(figure):
    assert figure in prose(README.read_text()), f"{figure} is no longer used; drop it from SPECIFIED"
