"""The watch's module and tensor hooks, and what one optimizer step collects through them.

A healthy step stays cheap: each module output gives one 0-dim `isfinite(...).all()` tensor in
forward and one for its gradient in backward (no `.item()`, so no device sync); one `stack`
at the step's end decides, and only a non-finite step looks for the first False. Ranges (amax)
are taken only on stats steps, also as 0-dim tensors turned into floats once at the end.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ampnb._tree import tensors
from ampnb.diagnosis.evidence import underflow


class Gone:
    """What a watch hook becomes when its module is pickled or deep-copied: does nothing."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None


class Hook:
    """A hook that pickles and deep-copies as `Gone` (a saved or copied model takes no watch)."""

    __slots__ = ("fn", "args")

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self.fn, self.args = fn, args

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*self.args, *args, **kwargs)

    def __reduce__(self) -> tuple:
        return (Gone, ())


def strip_gone(model: nn.Module) -> None:
    """Drop the `Gone` hooks a pickled watched model brought along."""
    for m in model.modules():
        for hooks in (m._forward_hooks, m._forward_pre_hooks):
            for k in [k for k, h in hooks.items() if isinstance(h, Gone)]:
                del hooks[k]


def finite_amax(t: torch.Tensor) -> torch.Tensor:
    """Largest finite |t| as a 0-dim float32 tensor (0 when none); no sync."""
    return torch.where(torch.isfinite(t), t.abs(), 0).amax().float()


def float_outputs(out: Any) -> list[torch.Tensor]:
    """The floating tensors a module returned (a tensor, or inside any container)."""
    found = [out] if isinstance(out, torch.Tensor) else tensors(out)
    return [t for t in found if t.is_floating_point() and t.numel()]


def module_names(model: nn.Module) -> tuple[list[nn.Module], list[str], list[int]]:
    """Every module, its name (the root: its class name, as the hunter says it) and the indices
    of those that get statistics: leaves and modules with parameters of their own."""
    mods, names, stats = [], [], []
    for i, (n, m) in enumerate(model.named_modules()):
        mods.append(m)
        names.append(n or type(m).__name__)
        if next(m.children(), None) is None or next(m.parameters(recurse=False), None) is not None:
            stats.append(i)
    return mods, names, stats


def _maxed(d: dict[int, torch.Tensor], i: int, v: torch.Tensor) -> None:
    d[i] = v if i not in d else torch.maximum(d[i], v)


class StepState:
    """What one optimizer step collected: tensors until its end, then floats."""

    def __init__(self, stats: bool) -> None:
        self.stats = stats
        self.t0 = math.nan
        self.micro_batches = 0
        self.losses: list[tuple[torch.Tensor, bool]] = []  # (root, scaled by the loss scale)
        self.explicit: list[float] = []                    # losses given to log_loss()
        self.forward: list[tuple[int, torch.Tensor]] = []  # (module, output finite), call order
        self.backward: list[tuple[int, torch.Tensor]] = []  # (module, output grad finite)
        self.act: dict[int, torch.Tensor] = {}
        self.act_grad: dict[int, torch.Tensor] = {}        # scaled where the loss was
        self.grad: dict[int, float] = {}
        self.flush: dict[int, float] = {}
        self.grads_read = False
        self.grads_finite: bool | None = None
        self.inputs: list[tuple[tuple, dict]] = []        # keep_overflow: this step's batches
        self.rng: dict[str, Any] | None = None
        self.autocast: list[tuple[str, torch.dtype]] = []
        self.before: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # true modes

    # ----- hooks ---------------------------------------------------------------------------

    def on_output(self, i: int, stats: bool, out: Any) -> None:
        """A module's forward ended: note whether its outputs are finite; ranges on stats steps."""
        for t in float_outputs(out):
            d = t.detach()
            self.forward.append((i, torch.isfinite(d).all()))
            if stats:
                _maxed(self.act, i, finite_amax(d))
            if t.requires_grad:
                t.register_hook(Hook(self.on_grad, i, stats))

    def on_grad(self, i: int, stats: bool, g: torch.Tensor) -> None:
        """The gradient of a module's output: finite or not; its range on stats steps."""
        self.backward.append((i, torch.isfinite(g).all()))
        if stats:
            _maxed(self.act_grad, i, finite_amax(g))

    def read_grads(self, modules: list[nn.Module], stats: list[int], divisor: float) -> None:
        """Parameter-gradient amax and fp16 flush share per stats module (grads / divisor)."""
        self.grads_read = True
        if not self.stats:
            return
        for i in stats:
            gs = [p.grad for p in modules[i].parameters(recurse=False) if p.grad is not None]
            if not gs:
                continue
            amax = torch.stack([finite_amax(g) for g in gs]).max()
            self.grad[i] = float(amax) / divisor
            self.flush[i] = underflow({str(k): g for k, g in enumerate(gs)}, 1.0 / divisor)

    def loss(self, scale: float | None) -> float:
        """Mean unscaled loss of the micro-batches (nan when none was seen)."""
        if self.explicit:
            return sum(self.explicit) / len(self.explicit)
        if not self.losses:
            return math.nan
        values = torch.stack([r.float().reshape(()) for r, _ in self.losses]).tolist()
        return sum(v / scale if scaled and scale else v
                   for v, (_, scaled) in zip(values, self.losses)) / len(values)

    def flags_finite(self) -> bool:
        """Every module output and output gradient of the step was finite (one sync)."""
        flags = [f for _, f in self.forward] + [f for _, f in self.backward]
        return bool(torch.stack(flags).all()) if flags else True

    def first_nonfinite(self) -> tuple[int | None, str]:
        """(module index, 'forward' | 'backward') of the first non-finite output or gradient."""
        for phase, flags in (("forward", self.forward), ("backward", self.backward)):
            if flags:
                ok = torch.stack([f for _, f in flags]).tolist()
                bad = next((k for k, v in enumerate(ok) if not v), None)
                if bad is not None:
                    return flags[bad][0], phase
        return None, ""
