"""A cell's code compiled once, run in the user namespace, with what it made and a reset."""

from __future__ import annotations

import ast
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ampnb._tree import named_leaves
from ampnb.display import dtype_name


@dataclass(frozen=True)
class CompiledCell:
    """The cell's statements, its last expression (kept for its value), and the names it uses."""

    body: types.CodeType
    last: types.CodeType | None
    names: frozenset[str]


class CellSyntaxError(Exception):
    """A SyntaxError in a %%amp cell, shown as IPython shows a plain cell's: no ampnb frames."""

    def __init__(self, shell: Any, error: SyntaxError) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.error, self._shell = error, shell

    def _render_traceback_(self) -> list[str]:
        # What InteractiveShell.showsyntaxerror() shows for a plain cell (no stack entries).
        return self._shell.SyntaxTB.structured_traceback(type(self.error), self.error, [])


_last: dict[tuple[int, Any, str], CompiledCell] = {}  # the cell being run, compiled once


def compile_cell(shell: Any, cell: str) -> CompiledCell:
    """Transform (IPython syntax), parse and compile a cell as IPython itself would (once per
    execution: the placement and the run ask for the same cell)."""
    key = (id(shell), shell.execution_count, cell)
    found = _last.get(key)
    if found is None:
        found = _compile(shell, cell)
        _last.clear()
        _last[key] = found
    return found


def _compile(shell: Any, cell: str) -> CompiledCell:
    try:
        code = shell.transform_cell(cell)
        # Cached under a name linecache knows, so tracebacks show the cell's own lines.
        filename = shell.compile.cache(code, shell.execution_count, raw_code=cell)
        tree = shell.transform_ast(shell.compile.ast_parse(code, filename=filename))
    except SyntaxError as e:
        raise CellSyntaxError(shell, e) from None
    names = frozenset(n.id for n in ast.walk(tree) if isinstance(n, ast.Name))
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = shell.compile(ast.Expression(tree.body.pop().value), filename, "eval")
    return CompiledCell(shell.compile(tree, filename, "exec"), last, names)


def run_cell(compiled: CompiledCell, ns: dict[str, Any]) -> Any:
    """Run the cell in ns; return its last expression's value (None if it has none)."""
    __tracebackhide__ = True  # noqa: F841 - IPython hides this frame in the user's traceback
    exec(compiled.body, ns)
    return None if compiled.last is None else eval(compiled.last, ns)


@dataclass(frozen=True)
class Made:
    """One tensor or module the cell created, changed or returned, and its dtype."""

    name: str
    kind: str
    dtype: str
    shape: str


def describe(name: str, value: Any) -> Made | None:
    """A line about a tensor or module; None for anything else."""
    if isinstance(value, torch.Tensor):
        return Made(name, f"Tensor ({value.device.type})", dtype_name(value.dtype),
                    str(list(value.shape)))
    if isinstance(value, torch.nn.Module):
        dtypes = sorted({dtype_name(p.dtype) for p in value.parameters()})
        n = sum(p.numel() for p in value.parameters())
        return Made(name, type(value).__name__, "params " + (", ".join(dtypes) or "-"), f"{n:,} params")
    return None


def describe_all(name: str, value: Any) -> list[Made]:
    """Lines about the tensors and modules in a value, inside any container (out.logits, ...)."""
    found = describe(name, value)
    if found is not None:
        return [found]
    return [m for path, leaf in named_leaves(value, name)
            if leaf is not value and (m := describe(path, leaf)) is not None]


class Watch:
    """Which names a cell rebinds or changes in place (tensors by their version counter)."""

    def __init__(self, ns: Mapping[str, Any], names: frozenset[str] | None = None) -> None:
        self.ns = ns
        self.names = names
        self.before = {k: _fingerprint(ns[k]) for k in self._names()}

    def _names(self) -> list[str]:
        keys = self.ns if self.names is None else (n for n in self.names if n in self.ns)
        return [k for k in keys if not k.startswith("_")]

    def changed(self) -> dict[str, Any]:
        """Names that are new, rebound, or hold a tensor changed in place."""
        return {k: self.ns[k] for k in self._names()
                if self.before.get(k) != _fingerprint(self.ns[k])}

    def made(self, value: Any) -> tuple[Made, ...]:
        """Tensors/modules that are new, rebound or changed in place, then the cell's value."""
        items = [*self.changed().items(), ("Out", value)]
        return tuple(m for k, v in items for m in describe_all(k, v))


def _fingerprint(value: Any) -> tuple[int, int | None]:
    try:
        return id(value), (value._version if isinstance(value, torch.Tensor) else None)
    except RuntimeError:  # inference-mode tensors have no version counter
        return id(value), None
