"""Modules that draw random numbers in their own code, found in one forward, and kept from drawing.

Seeding every generator alike makes most draws equal across modes, but not all: on CUDA,
`scaled_dot_product_attention` picks its kernel by dtype and each kernel draws its dropout mask
its own way; any op whose random use depends on the dtype does the same. A difference in the
masks would read as precision error, so the doctor takes its figures with these modules not
drawing (their own `training` flag off: dropout-like behaviour only, children untouched).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampnb.putback import Rng


class DrawFinder:
    """Forward hooks on every module: which modules drew random numbers in their own code (not
    only inside a child), by the generators' states at each module's entry, exit and children."""

    def __init__(self, net: nn.Module) -> None:
        self.drew: dict[str, None] = {}
        self.stack: list[list[Any]] = []  # [name, the generators' state when last looked]
        self.handles = []
        for name, module in net.named_modules():
            self.handles.append(module.register_forward_pre_hook(self._enter(name)))
            self.handles.append(module.register_forward_hook(self._leave()))

    def _enter(self, name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            now = Rng.take()
            if self.stack and not now.same(self.stack[-1][1]):
                self.drew[self.stack[-1][0]] = None  # the parent drew before calling this child
            self.stack.append([name, now])
        return hook

    def _leave(self) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            if not self.stack:
                return
            name, last = self.stack.pop()
            now = Rng.take()
            if not now.same(last):
                self.drew[name] = None
            if self.stack:
                self.stack[-1][1] = now  # a child's draws are its own
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@dataclass(frozen=True)
class Quiet:
    """The modules kept from drawing during the doctor's steps, and why (empty: none drew)."""

    modules: tuple[str, ...] = ()
    root_draws: bool = False  # the model's own forward draws: seeded alike, cannot be turned off

    @property
    def note(self) -> str:
        """One line for the report ('' when nothing drew)."""
        parts = []
        if self.modules:
            shown = ", ".join(self.modules[:4]) + (f" and {len(self.modules) - 4} more"
                                                   if len(self.modules) > 4 else "")
            parts.append(f"errors and timings taken with {len(self.modules)} module(s) that draw "
                         f"random numbers not drawing ({shown}: their training flag off): the "
                         "same seed can draw different masks per dtype (CUDA's attention kernels "
                         "do), which would read as precision error")
        if self.root_draws:
            parts.append("the model's own forward draws random numbers: torch, numpy and "
                         "Python's random are seeded alike in every mode")
        return "; ".join(parts)

    def apply(self, net: nn.Module) -> None:
        """Turn the drawing modules' own training flag off in a copy (children keep theirs)."""
        modules = dict(net.named_modules())
        for name in self.modules:
            if name in modules:
                modules[name].training = False


def find(net: nn.Module, forward: Callable[[], Any], grad: bool = False) -> Quiet:
    """Run `forward` (no gradients unless `grad`: a cell's code may call backward itself) with
    every module watched: the modules that drew."""
    finder = DrawFinder(net)
    try:
        with torch.set_grad_enabled(grad):
            forward()
    finally:
        finder.remove()
    drew = tuple(n for n in finder.drew if n)
    return Quiet(drew, "" in finder.drew)
