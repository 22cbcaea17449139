"""Build the tutorials: each notebooks/src/NN_name.py (jupytext percent) -> notebooks/NN_name.ipynb.

    python notebooks/src/build.py               # execute and write every notebook
    python notebooks/src/build.py 03 04_fp8     # only these (a number, a stem or a path)
    python notebooks/src/build.py --check       # no kernel: list notebooks whose cells differ from their script

The script is the source of truth. Building executes it (kernel python3, cwd notebooks/ where the
learner runs it, this checkout's ampnb first on the path), keeps the outputs of checked cells only
(nbval compares only stored outputs) and writes canonical JSON without timestamps, so a rebuild
is a quiet diff.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

import jupytext
import nbformat
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

SRC = Path(__file__).resolve().parent  # the scripts and this tooling
NOTEBOOKS = SRC.parent  # the built .ipynb files, what JupyterLab opens
ROOT = NOTEBOOKS.parent
KERNEL = "python3"
METADATA = {"kernelspec": {"name": KERNEL, "display_name": "Python 3", "language": "python"},
            "language_info": {"name": "python"}}
CHECK = "# NBVAL_CHECK_OUTPUT"
CHECK_TAG = "nbval-check-output"
FORMAT = "py:percent"
NEW_CELL = {"code": new_code_cell, "markdown": new_markdown_cell}


def scripts() -> list[Path]:
    """Every tutorial script, in order."""
    return sorted(SRC.glob("[0-9][0-9]_*.py"))


def resolve(names: list[str]) -> list[Path]:
    """The scripts named by number (03), stem (03_gradscaler...) or path (.py or .ipynb)."""
    if not names:
        return scripts()
    found = []
    for name in names:
        stem = Path(name).stem
        match = [p for p in scripts() if p.stem == stem or p.stem.startswith(stem)]
        if len(match) != 1:
            allowed = ", ".join(p.stem for p in scripts())
            raise SystemExit(f"build.py: {name!r} names {len(match)} notebooks; one of: {allowed}")
        found.append(match[0])
    return found


def from_script(script: Path) -> nbformat.NotebookNode:
    """The unexecuted notebook of a script: its cells, stable ids, the one kernelspec."""
    text = jupytext.read(script, fmt=FORMAT)
    cells = [NEW_CELL[c.cell_type](c.source, metadata=dict(c.metadata)) for c in text.cells]
    for i, cell in enumerate(cells):
        cell.id = f"{script.stem[:2]}-{i:02d}"  # stable ids: rebuilding gives no diff
    return new_notebook(cells=cells, metadata=copy.deepcopy(METADATA))


def is_checked(cell: nbformat.NotebookNode) -> bool:
    """Whether nbval compares this cell's output."""
    return cell.cell_type == "code" and (cell.source.startswith(CHECK)
                                         or CHECK_TAG in cell.metadata.get("tags", []))


def merge_streams(outputs: list) -> list:
    """Join consecutive stdout/stderr pieces, as nbval does before comparing."""
    merged: list = []
    for out in outputs:
        last = merged[-1] if merged else None
        if (out.output_type == "stream" and last is not None and last.output_type == "stream"
                and last.name == out.name):
            last.text += out.text
        else:
            merged.append(out)
    return merged


def keep_checked_outputs(executed: nbformat.NotebookNode,
                         source: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The source notebook with the text outputs of its checked cells; nothing else from the run."""
    nb = copy.deepcopy(source)
    for cell, ran in zip(nb.cells, executed.cells, strict=True):
        if cell.cell_type != "code" or not is_checked(cell):
            continue
        # nbval compares a checked cell only if it has a reference output and an execution count.
        cell.execution_count = ran.execution_count
        cell.outputs = merge_streams(copy.deepcopy(ran.outputs))
        for out in cell.outputs:
            if "data" in out:  # text only: images and widget views are never compared
                out.data = {k: v for k, v in out.data.items() if k == "text/plain"}
                out.metadata = {}
    return nb


def execute(nb: nbformat.NotebookNode, timeout: int = 300) -> nbformat.NotebookNode:
    """Run a copy of the notebook in a fresh python3 kernel from notebooks/."""
    # The kernel imports this checkout's ampnb, not whichever one the venv has installed.
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    ran = copy.deepcopy(nb)
    NotebookClient(ran, timeout=timeout, kernel_name=KERNEL, record_timing=False,
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute(
                       env={**os.environ, "PYTHONPATH": path})
    return ran


def dumps(nb: nbformat.NotebookNode) -> str:
    """Canonical JSON (sorted keys, one-space indent, final newline): equal notebooks, equal bytes."""
    nbformat.validate(nb)
    return nbformat.writes(nb).rstrip("\n") + "\n"


def notebook(script: Path) -> Path:
    """Where a script's notebook is stored: notebooks/NN_name.ipynb."""
    return NOTEBOOKS / f"{script.stem}.ipynb"


def build(script: Path, timeout: int = 300) -> Path:
    """Execute the script's notebook and write it to notebooks/."""
    nb = from_script(script)
    target = notebook(script)
    target.write_text(dumps(keep_checked_outputs(execute(nb, timeout), nb)))
    return target


def stale(script: Path) -> list[str]:
    """How the stored notebook's cells differ from the script's (empty when they agree)."""
    target = notebook(script)
    if not target.exists():
        return [f"{target.name} is missing"]
    want, have = from_script(script).cells, nbformat.read(target, as_version=4).cells
    if len(want) != len(have):
        return [f"{target.name}: {len(have)} cells, {script.name} makes {len(want)}"]
    fields = ("cell_type", "source", "metadata", "id")
    return [f"{target.name} cell {i} differs from {script.name} in "
            + ", ".join(f for f in fields if w.get(f) != h.get(f))
            for i, (w, h) in enumerate(zip(want, have))
            if any(w.get(f) != h.get(f) for f in fields)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="notebooks to build (default: all)")
    parser.add_argument("--check", action="store_true",
                        help="execute nothing; fail if a notebook's cells differ from its script")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per cell")
    args = parser.parse_args(argv)
    chosen = resolve(args.names)
    if args.check:
        problems = [line for script in chosen for line in stale(script)]
        print("\n".join(problems) or f"{len(chosen)} notebooks match their scripts")
        return 1 if problems else 0
    for script in chosen:
        print(build(script, args.timeout).relative_to(ROOT), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
