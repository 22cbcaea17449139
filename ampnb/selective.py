"""Selective precision: chosen modules run in fp32 whatever the mode (`keep_fp32`)."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ampnb._interrupt import Guard
from ampnb._tree import map_tensors

_AUTOCAST_DEVICES = ("cpu", "cuda")


def keep_patterns(patterns: str | Iterable[str]) -> tuple[str, ...]:
    """Module paths or globs from 'a,b' or an iterable (ValueError when there are none)."""
    items = patterns.split(",") if isinstance(patterns, str) else \
        list(patterns) if isinstance(patterns, Iterable) else None
    found = tuple(p.strip() if isinstance(p, str) else p for p in items or ())
    if not found or not all(isinstance(p, str) and p for p in found):
        raise ValueError(f"keep_fp32 needs module paths or globs, got {patterns!r}; allowed: a "
                         f"string such as 'lm_head,*.norm' or a list of strings such as "
                         f"['lm_head', '*.norm']")
    return found


def _roots(model: nn.Module | Mapping[str, nn.Module]) -> dict[str, nn.Module]:
    """{name: model}: one model ('' as its name) or several by name (a notebook's models)."""
    models = {"": model} if isinstance(model, nn.Module) else dict(model) if isinstance(
        model, Mapping) else None
    if not models or not all(isinstance(m, nn.Module) for m in models.values()):
        raise ValueError(f"keep_fp32 needs an nn.Module (or a dict of them by name), got "
                         f"{type(model).__name__}")
    return models


def matching_modules(model: nn.Module | Mapping[str, nn.Module],
                     patterns: str | Iterable[str]) -> dict[str, nn.Module]:
    """Modules whose dotted path matches a pattern ('*' wildcards); outermost matches only.

    With several models by name, paths are matched inside each and returned as 'name.path';
    every pattern must match in at least one of them.
    """
    wanted = keep_patterns(patterns)
    roots = _roots(model)
    named = [(root, n, m) for root, r in roots.items() for n, m in r.named_modules() if n]
    unmatched = [p for p in wanted if not any(fnmatch.fnmatchcase(n, p) for _, n, _ in named)]
    if unmatched:
        some = ", ".join(n for _, n, _ in named[:8])
        owner = " or ".join(type(r).__name__ for r in roots.values())
        raise ValueError(f"keep_fp32 pattern {unmatched[0]!r} matches no module of {owner}; "
                         f"module paths look like: {some}")
    chosen: dict[str, nn.Module] = {}
    for root, name, module in named:
        path = f"{root}.{name}" if root else name
        if any(fnmatch.fnmatchcase(name, p) for p in wanted) and not any(
                path.startswith(f"{outer}.") for outer in chosen):
            chosen[path] = module
    return chosen


_NARROW_DEFAULT = {torch.float16: torch.float16, torch.bfloat16: torch.bfloat16}


def _to_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.is_floating_point() and t.dtype != torch.float64 else t


Shared = list[tuple[nn.Module, str, nn.Parameter]]  # (owning module, name, parameter)


def _swap_in(shared: Shared) -> Shared:
    for owner, name, p in shared:
        owner._parameters[name] = p.float()  # differentiable: the gradient reaches p
    return shared


def _swap_out(shared: Shared) -> None:
    for owner, name, p in shared:
        owner._parameters[name] = p


def _fp32_forward(forward: Any, back_to: torch.dtype | None, shared: Shared = ()) -> Any:
    """forward with autocast off and floating inputs in fp32; outputs cast to back_to if given.

    Without back_to, outputs go back to the default dtype where a true mode made it narrow
    (a module kept in fp32 for good, e.g. by the Workbench, inside a bf16-true model).
    `shared`: narrow parameters the module shares with modules not kept; the forward sees fp32
    casts of them (their own dtype stays as it is).
    """
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False), \
                Guard(lambda: _swap_in(list(shared)), _swap_out):
            out = forward(*map_tensors(_to_fp32, args), **map_tensors(_to_fp32, kwargs))
        back = back_to if back_to is not None else _NARROW_DEFAULT.get(torch.get_default_dtype())
        if back is None:
            return out
        return map_tensors(lambda t: t.to(back) if t.dtype == torch.float32 else t, out)

    run.ampnb_keep_fp32 = True
    return run


def _low_precision(module: nn.Module, skip: frozenset[int] = frozenset()) -> torch.dtype | None:
    """The narrow dtype a true mode gave the module's parameters (those not in skip), or None
    if they are fp32/fp64."""
    dtypes = {p.dtype for p in module.parameters() if p.is_floating_point() and id(p) not in skip}
    narrow = dtypes - {torch.float32, torch.float64}
    return narrow.pop() if len(narrow) == 1 else None


def _own_params(module: nn.Module) -> Shared:
    """Every (owning submodule, name, parameter) inside module, tied ones at each owner."""
    return [(m, name, p) for m in module.modules() for name, p in m._parameters.items()
            if p is not None]


def _outside_params(roots: dict[str, nn.Module], chosen: dict[str, nn.Module]) -> set[int]:
    """ids of the parameters that modules outside the kept ones hold (to leave their dtype)."""
    inside = {id(m) for c in chosen.values() for m in c.modules()}
    return {id(p) for r in roots.values() for m in r.modules() if id(m) not in inside
            for p in m._parameters.values() if p is not None}


def _widen(module: nn.Module, keep: frozenset[int]) -> None:
    """module.float(), except the tensors in keep (shared parameters) and their gradients."""
    skip = keep | {id(p.grad) for p in module.parameters() if id(p) in keep and p.grad is not None}
    module._apply(lambda t: t if id(t) in skip or not t.is_floating_point() else t.float())


def widen_kept(model: nn.Module | Mapping[str, nn.Module], patterns: str | Iterable[str]) -> None:
    """Widen the matched modules' weights to fp32 for good (a true mode's kept modules), except
    parameters shared with modules not kept: those keep their dtype (keep_fp32 casts them)."""
    chosen = matching_modules(model, patterns)
    outside = _outside_params(_roots(model), chosen)
    for module in chosen.values():
        _widen(module, frozenset(id(p) for _, _, p in _own_params(module) if id(p) in outside))


@contextmanager
def keep_fp32(model: nn.Module | Mapping[str, nn.Module],
              patterns: str | Iterable[str]) -> Iterator[dict[str, nn.Module]]:
    """Matched modules run with autocast off and fp32 inputs; in true modes with fp32 weights too.

    In a true mode (bf16/fp16 weights) the matched modules' weights are widened to fp32 for the
    body and their outputs cast back to the mode's dtype at their boundary; on exit the weights
    go back to the mode's dtype (rounded once if they were trained in fp32 meanwhile).
    """
    chosen = matching_modules(model, patterns)
    outside = _outside_params(_roots(model), chosen)

    def enter() -> list[tuple[nn.Module, Any, torch.dtype | None]]:
        done: list[tuple[nn.Module, Any, torch.dtype | None]] = []
        try:
            for module in chosen.values():
                narrow = _low_precision(module)  # what its outputs go back to
                shared: Shared = [(owner, name, p) for owner, name, p in _own_params(module)
                                  if id(p) in outside and p.dtype == narrow]
                ids = frozenset(id(p) for _, _, p in shared)
                widened = narrow is not None and _low_precision(module, ids) is not None
                done.append((module, module.__dict__.get("forward"), narrow if widened else None))
                if widened:
                    _widen(module, ids)
                module.forward = _fp32_forward(module.forward, narrow, shared)
        except Exception:
            exit(done)
            raise
        return done

    def exit(done: list[tuple[nn.Module, Any, torch.dtype | None]]) -> None:
        for module, own_forward, narrow in reversed(done):
            if own_forward is not None:  # a forward the user had set on the instance
                module.forward = own_forward
            else:
                module.__dict__.pop("forward", None)
            if narrow is not None:
                module.to(narrow)

    with Guard(enter, exit):
        yield chosen
