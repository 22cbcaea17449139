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
    found = tuple(p.strip() for p in (patterns.split(",") if isinstance(patterns, str) else patterns))
    if not found or not all(isinstance(p, str) and p for p in found):
        raise ValueError(f"keep_fp32 needs module paths or globs (e.g. 'lm_head,*.norm'), got "
                         f"{patterns!r}")
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


def _fp32_forward(forward: Any, back_to: torch.dtype | None) -> Any:
    """forward with autocast off and floating inputs in fp32; outputs cast to back_to if given.

    Without back_to, outputs go back to the default dtype where a true mode made it narrow
    (a module kept in fp32 for good, e.g. by the Workbench, inside a bf16-true model).
    """
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            out = forward(*map_tensors(_to_fp32, args), **map_tensors(_to_fp32, kwargs))
        back = back_to if back_to is not None else _NARROW_DEFAULT.get(torch.get_default_dtype())
        if back is None:
            return out
        return map_tensors(lambda t: t.to(back) if t.dtype == torch.float32 else t, out)

    run.ampnb_keep_fp32 = True
    return run


def _low_precision(module: nn.Module) -> torch.dtype | None:
    """The narrow dtype a true mode gave the module's parameters, or None if they are fp32/fp64."""
    dtypes = {p.dtype for p in module.parameters() if p.is_floating_point()}
    narrow = dtypes - {torch.float32, torch.float64}
    return narrow.pop() if len(narrow) == 1 else None


@contextmanager
def keep_fp32(model: nn.Module | Mapping[str, nn.Module],
              patterns: str | Iterable[str]) -> Iterator[dict[str, nn.Module]]:
    """Matched modules run with autocast off and fp32 inputs; in true modes with fp32 weights too.

    In a true mode (bf16/fp16 weights) the matched modules' weights are widened to fp32 for the
    body and their outputs cast back to the mode's dtype at their boundary; on exit the weights
    go back to the mode's dtype (rounded once if they were trained in fp32 meanwhile).
    """
    chosen = matching_modules(model, patterns)

    def enter() -> list[tuple[nn.Module, Any, torch.dtype | None]]:
        done: list[tuple[nn.Module, Any, torch.dtype | None]] = []
        try:
            for module in chosen.values():
                narrow = _low_precision(module)
                done.append((module, module.__dict__.get("forward"), narrow))
                if narrow is not None:
                    module.float()
                module.forward = _fp32_forward(module.forward, narrow)
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
