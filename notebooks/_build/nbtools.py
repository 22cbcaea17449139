"""Tiny helpers to write tutorial notebooks with nbformat: one kernelspec, checked outputs kept."""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

NOTEBOOKS = Path(__file__).resolve().parent.parent
KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}
CHECK = "# NBVAL_CHECK_OUTPUT"
CHECK_TAG = "nbval-check-output"


def md(text: str) -> nbformat.NotebookNode:
    """A markdown cell."""
    return new_markdown_cell(text.strip("\n"))


def code(text: str) -> nbformat.NotebookNode:
    """A code cell whose output nbval does not compare (timings, plots, widgets)."""
    return new_code_cell(text.strip("\n"))


def checked(text: str) -> nbformat.NotebookNode:
    """A code cell with deterministic output that nbval compares."""
    return new_code_cell(CHECK + "\n" + text.strip("\n"))


def solution(text: str, check: bool = False) -> nbformat.NotebookNode:
    """An exercise's solution: a code cell shown collapsed in JupyterLab, still run by nbval."""
    cell = checked(text) if check else new_code_cell(text.strip("\n"))
    cell.metadata["jupyter"] = {"source_hidden": True}
    cell.metadata["tags"] = ["solution"]
    return cell


def _is_checked(cell: nbformat.NotebookNode) -> bool:
    return cell.cell_type == "code" and (cell.source.startswith(CHECK)
                                         or CHECK_TAG in cell.metadata.get("tags", []))


def _merge_streams(outputs: list) -> list:
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


def _keep_checked_outputs(nb: nbformat.NotebookNode) -> None:
    """Keep the reference output of checked cells (nbval compares only those); clear the rest."""
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if _is_checked(cell):
            cell.outputs = _merge_streams(cell.outputs)
            for out in cell.outputs:
                if "data" in out:  # text only: images and widget views are never compared
                    out["data"] = {k: v for k, v in out["data"].items() if k == "text/plain"}
        else:
            cell.outputs, cell.execution_count = [], None


def _execute_and_save(nb: nbformat.NotebookNode, path: Path, timeout: int) -> Path:
    # nbval compares a checked cell only if it has a reference output and an execution count.
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    nb.metadata = {"kernelspec": KERNELSPEC, "language_info": {"name": "python"}}
    _keep_checked_outputs(nb)
    nbformat.validate(nb)
    nbformat.write(nb, path)
    return path


def write(name: str, cells: list[nbformat.NotebookNode], timeout: int = 300) -> Path:
    """Execute the cells, then write notebooks/<name> with only the checked cells' outputs."""
    for i, cell in enumerate(cells):
        cell.id = f"{Path(name).stem[:2]}-{i:02d}"  # stable ids: rebuilding gives no diff
    return _execute_and_save(new_notebook(cells=cells), NOTEBOOKS / name, timeout)


def refresh(path: Path, timeout: int = 300) -> Path:
    """Re-execute an existing notebook and store its checked cells' reference outputs."""
    return _execute_and_save(nbformat.read(path, as_version=4), Path(path), timeout)


if __name__ == "__main__":
    import sys

    for arg in sys.argv[1:]:  # e.g. notebooks/03_gradscaler_step_by_step.ipynb
        print(refresh(Path(arg).resolve()))
