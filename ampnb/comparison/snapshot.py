"""The state a cell can reach: saved once, restored exactly, converted per mode for a run.

`--compare` reruns a cell under several modes. A cell that calls `train_step()` changes a
model and an optimizer it never names, so everything reachable from the namespace (its
values, and what plain containers, dataclasses and ModelOutputs there hold) is saved:
modules' parameters, buffers, gradients and train/eval flags, optimizers, GradScalers, LR
schedulers, free tensors, every RNG, and the namespace's own bindings. The copies and their
putting back are `ampnb.putback`'s; what is reached, and how, is decided here.
"""

from __future__ import annotations

import types
from collections.abc import Iterable, MutableMapping
from typing import Any

import torch
from torch import nn

from ampnb._tree import named_leaves
from ampnb.modes import PrecisionMode
from ampnb.putback import (
    ModuleFlags,
    ObjectCopy,
    OptimizerCopy,
    Rng,
    TensorCopy,
    user_generators,
    version,
)
from ampnb.selective import matching_modules

TENSOR_BUDGET = 256 * 2**20  # free tensors copied up to this many bytes; larger ones are watched
_SKIP = {"In", "Out", "exit", "quit", "get_ipython"}
_OBJECTS = (torch.optim.Optimizer, torch.amp.GradScaler, torch.optim.lr_scheduler.LRScheduler)


def _walk(value: Any, name: str) -> list[tuple[str, Any]]:
    """(path, leaf) inside a value, closures and bound methods included; [] if it cannot be walked."""
    if isinstance(value, types.MethodType):
        value = (value.__self__,)
        name += ".__self__"
    elif isinstance(value, types.FunctionType):  # make_step(model, opt) keeps them in a closure
        value = [c.cell_contents for c in value.__closure__ or () if _filled(c)]
        name += ".<closure>"
    try:
        return list(named_leaves(value, name))
    except Exception:  # noqa: BLE001 - a cyclic (RecursionError) or odd container: skip it
        return []


def _filled(cell: Any) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


def used_names(names: Iterable[str], ns: MutableMapping[str, Any]) -> set[str]:
    """The cell's names and the globals read by the functions and classes it reaches."""
    found, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        value = ns.get(name)
        cls = value if isinstance(value, type) else type(value)
        if isinstance(value, types.MethodType):
            value = value.__func__
        if isinstance(value, types.FunctionType) and value.__globals__ is ns:
            todo.extend(_code_names(value.__code__))
        elif cls.__module__ == ns.get("__name__"):  # a class defined in the notebook
            for attr in vars(cls).values():
                if isinstance(attr, types.FunctionType) and attr.__globals__ is ns:
                    todo.extend(_code_names(attr.__code__))
    return found


def module_roots(ns: MutableMapping[str, Any], used: Iterable[str]) -> dict[str, nn.Module]:
    """The outermost modules under the names `used`, by path (in containers and closures too)."""
    seen: dict[int, tuple[str, nn.Module]] = {}
    for name in sorted(used):
        value = ns.get(name)
        if name.startswith("_") or name in _SKIP or isinstance(value, (types.ModuleType, type)):
            continue
        for path, leaf in _walk(value, name):
            if isinstance(leaf, nn.Module):
                seen.setdefault(id(leaf), (path, leaf))
    inner = {id(c) for _, m in seen.values() for c in m.modules() if c is not m}
    return {p: m for i, (p, m) in seen.items() if i not in inner}


def _top(path: str) -> str:
    """'data[0].model' -> 'data'."""
    return path.split("[", 1)[0].split(".", 1)[0]


def _code_names(code: types.CodeType) -> list[str]:
    names = list(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names += _code_names(c)
    return names


class StartState:
    """What a namespace reaches, saved now; `restore()` puts all of it back exactly."""

    def __init__(self, ns: MutableMapping[str, Any], used: Iterable[str] = ()) -> None:
        self.ns, self.used = ns, set(used)
        self.bindings = dict(ns)
        self.found: dict[str, str] = {}  # name -> what kind of state it holds
        self.modules: dict[int, nn.Module] = {}
        self.objects: list[Any] = []
        self.unsaved: list[str] = []  # large free tensors: watched, not copied
        seen: dict[int, Any] = {}
        leaves: list[Any] = []
        for name, value in self.bindings.items():
            if name.startswith("_") or name in _SKIP or isinstance(value, (types.ModuleType, type)):
                continue
            for path, leaf in _walk(value, name):
                leaves.append(leaf)
                if id(leaf) not in seen and isinstance(leaf, (nn.Module, torch.Tensor, *_OBJECTS)):
                    seen[id(leaf)] = (path, leaf)
        for path, leaf in list(seen.values()):  # what schedulers hold is reachable too
            if isinstance(leaf, torch.optim.lr_scheduler.LRScheduler):
                inner = [(f"{path}.optimizer", getattr(leaf, "optimizer", None))]
                inner += [(f"{path}._schedulers[{i}]", s)  # SequentialLR, ChainedScheduler
                          for i, s in enumerate(getattr(leaf, "_schedulers", ()))]
                for p, obj in inner:
                    if obj is not None and id(obj) not in seen:
                        seen[id(obj)] = (p, obj)
        # the user's own generators (g = torch.Generator(); a DataLoader's) start each run alike
        self.rng = Rng.take(user_generators(leaves))
        # Deep copies of a scheduler's or scaler's attributes keep these objects themselves.
        self.memo = {i: obj for i, (_, obj) in seen.items()}
        self._save(list(seen.values()))

    def _save(self, items: list[tuple[str, Any]]) -> None:
        tensors: dict[int, TensorCopy] = {}
        flags = []
        for path, obj in items:
            if isinstance(obj, nn.Module):
                self.modules[id(obj)] = obj
                for m in obj.modules():
                    flags.append(ModuleFlags.take(m))
                for t in [*obj.parameters(), *obj.buffers()]:
                    tensors.setdefault(id(t), TensorCopy.take(t))
                self.found[path] = type(obj).__name__
            elif isinstance(obj, torch.optim.Optimizer):
                for g in obj.param_groups:
                    for p in g["params"]:
                        tensors.setdefault(id(p), TensorCopy.take(p))
                self.objects.append(OptimizerCopy.take(obj))
                self.found[path] = type(obj).__name__
            elif not isinstance(obj, torch.Tensor):
                self.objects.append(ObjectCopy.take(obj, self.memo))
                self.found[path] = type(obj).__name__
        budget = TENSOR_BUDGET
        self.watched: dict[str, tuple[torch.Tensor, int | None]] = {}
        for path, obj in items:
            if isinstance(obj, torch.Tensor) and id(obj) not in tensors:
                size = obj.numel() * obj.element_size()
                if size <= budget:
                    budget -= size
                    tensors[id(obj)] = TensorCopy.take(obj)
                else:
                    self.watched[path] = (obj, version(obj))
        self.flags = flags
        self.tensors = list(tensors.values())
        roots = set(self.modules)
        for m in self.modules.values():
            roots -= {id(c) for c in m.modules() if c is not m}
        self.roots = {p: m for p, m in ((p, o) for p, o in items if id(o) in roots)}

    def restore(self) -> None:
        """Everything back as it was when saved: bindings, modules, optimizers, tensors, RNG."""
        ns = self.ns
        for k in [k for k in ns if k not in self.bindings]:
            del ns[k]
        for k, v in self.bindings.items():
            if ns.get(k, self) is not v:
                ns[k] = v
        for f in self.flags:
            f.restore()
        for t in self.tensors:
            t.restore()
        for o in self.objects:
            o.restore()
        self.rng.restore()

    def convert(self, mode: PrecisionMode) -> list[str]:
        """Convert the modules (convert_module) and the inputs the cell uses (convert_input).

        Mixed modes convert nothing (autocast lowers the compute); returns what was converted.
        """
        if mode.is_mixed or mode.param_dtype == torch.float32:
            return []
        done = []
        for path, m in self.used_modules().items():
            mode.convert_module(m)
            done.append(path)
        params = {id(t.tensor) for t in self.tensors if isinstance(t.tensor, nn.Parameter)}
        for name in sorted(self.used):
            value = self.ns.get(name)
            if value is None or isinstance(value, (nn.Module, types.FunctionType)):
                continue
            floats = [t for _, t in named_leaves(value) if isinstance(t, torch.Tensor)
                      and t.is_floating_point() and id(t) not in params]
            if floats:
                self.ns[name] = mode.convert_input(value)
                done.append(name)
        return done

    def used_modules(self) -> dict[str, nn.Module]:
        """The root modules under a name the cell uses (directly or through its functions)."""
        return {p: m for p, m in self.roots.items() if _top(p) in self.used}

    def changed_modules(self) -> dict[str, nn.Module]:
        """The root modules whose parameters or buffers the run changed."""
        changed = {id(t.tensor) for t in self.tensors if t.changed()}
        return {p: m for p, m in self.roots.items()
                if any(id(t) in changed for t in [*m.parameters(), *m.buffers()])}

    def unrestored(self) -> list[str]:
        """Large tensors the runs changed in place (watched, too large to copy)."""
        return [p for p, (t, v) in self.watched.items() if version(t) != v]

    def summary(self, limit: int = 8) -> str:
        """'model (GPT2LMHeadModel), opt (AdamW)'."""
        items = [f"{p} ({k})" for p, k in self.found.items()]
        more = f" and {len(items) - limit} more" if len(items) > limit else ""
        return (", ".join(items[:limit]) + more) or "no module, optimizer, scaler or scheduler"


KEEP_NEEDS_A_MODEL = ("--keep-fp32 needs a model made before the cell (an nn.Module the cell or "
                      "the functions it calls use); none found")


def cell_models(keep: tuple[str, ...], ns: dict[str, Any], names: Iterable[str]) -> dict[str, nn.Module]:
    """The models a cell uses (by name), as `%%amp --keep-fp32` finds them; {} when none kept.

    ValueError when modules are kept but the cell uses no model, or a pattern matches nothing.
    """
    if not keep:
        return {}
    models = module_roots(ns, used_names(names, ns))
    if not models:
        raise ValueError(KEEP_NEEDS_A_MODEL)
    matching_modules(models, keep)  # every pattern must name a module
    return models
