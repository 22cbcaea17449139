"""A cell's code compiled once, run in the user namespace, with what it made and a reset."""

from __future__ import annotations

import ast
import copy
import types
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class CompiledCell:
    """The cell's statements, its last expression (kept for its value), and the names it uses."""

    body: types.CodeType
    last: types.CodeType | None
    names: frozenset[str]


def compile_cell(shell: Any, cell: str) -> CompiledCell:
    """Transform (IPython syntax), parse and compile a cell as IPython itself would."""
    code = shell.transform_cell(cell)
    # Cached under a name linecache knows, so tracebacks show the cell's own lines.
    filename = shell.compile.cache(code, shell.execution_count, raw_code=cell)
    tree = shell.transform_ast(shell.compile.ast_parse(code, filename=filename))
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


def _is_data(value: Any) -> bool:
    """Values a cell's rerun must start afresh from: not modules, classes or plain functions."""
    if isinstance(value, (types.ModuleType, type)):
        return False
    return isinstance(value, torch.nn.Module) or not callable(value)


class NamespaceReset:
    """Fresh deep copies of the values a cell touches, for rerunning it from the same start."""

    def __init__(self, ns: MutableMapping[str, Any], names: frozenset[str]) -> None:
        self.ns = ns
        self.original = {n: ns[n] for n in sorted(names) if n in ns and _is_data(ns[n])}
        self.absent = sorted(n for n in names if n not in ns)
        self.shared: tuple[str, ...] = ()
        # Tensors computed with grad (e.g. y = model(x)) refuse deepcopy; a detached copy of
        # the value is what a rerun needs, so seed deepcopy's memo with one.
        memo = {id(v): v.detach().clone() for v in self.original.values()
                if isinstance(v, torch.Tensor) and not v.is_leaf}
        try:
            # One deepcopy of all of them, so an optimizer still points at its model's copy.
            self.saved = copy.deepcopy(self.original, memo)
        except Exception:  # noqa: BLE001 - any value may refuse to be copied; share those
            self.saved = {}
            for n, v in self.original.items():
                try:
                    self.saved[n] = copy.deepcopy(v)
                except Exception:  # noqa: BLE001
                    self.shared += (n,)

    def fresh(self) -> None:
        """Rebind every touched name to a new copy of its starting value."""
        self._clear()
        self.ns.update(copy.deepcopy(self.saved))

    def originals(self) -> None:
        """Rebind the user's own objects (for the final run, so they end as after one run)."""
        self._clear()
        self.ns.update(self.original)

    def _clear(self) -> None:
        for n in self.absent:
            self.ns.pop(n, None)


@dataclass(frozen=True)
class Made:
    """One tensor or module the cell created, changed or returned, and its dtype."""

    name: str
    kind: str
    dtype: str
    shape: str


def _dtype(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def describe(name: str, value: Any) -> Made | None:
    """A line about a tensor or module; None for anything else."""
    if isinstance(value, torch.Tensor):
        return Made(name, f"Tensor ({value.device.type})", _dtype(value.dtype), str(list(value.shape)))
    if isinstance(value, torch.nn.Module):
        dtypes = sorted({_dtype(p.dtype) for p in value.parameters()})
        n = sum(p.numel() for p in value.parameters())
        return Made(name, type(value).__name__, "params " + (", ".join(dtypes) or "-"), f"{n:,} params")
    return None


def _items(value: Any, name: str) -> list[tuple[str, Any]]:
    if isinstance(value, (list, tuple)):
        return [(f"{name}[{i}]", v) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        return [(f"{name}[{k!r}]", v) for k, v in value.items()]
    return [(name, value)]


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

    def made(self, value: Any, limit: int = 8) -> tuple[Made, ...]:
        """Tensors/modules that are new, rebound or changed in place, then the cell's value."""
        found = [describe(k, v) for k, v in [*self.changed().items(), *_items(value, "Out")]]
        return tuple(m for m in found if m is not None)[:limit]


def _fingerprint(value: Any) -> tuple[int, int | None]:
    try:
        return id(value), (value._version if isinstance(value, torch.Tensor) else None)
    except RuntimeError:  # inference-mode tensors have no version counter
        return id(value), None
