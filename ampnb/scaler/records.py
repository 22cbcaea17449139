"""What the stepper saw: per-stage and per-step records, gradient statistics, the history table."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch._utils import _flatten_dense_tensors

from ampnb.display import Table


@dataclass(frozen=True)
class GradStats:
    """Summary of all parameter gradients at one moment (fp32 arithmetic)."""

    norm: float
    max_abs: float
    min_abs_nonzero: float | None  # measured where underflow matters: after unscale_
    nonfinite: int
    numel: int

    def summary(self) -> str:
        low = "" if self.min_abs_nonzero is None else f", min nonzero {self.min_abs_nonzero:.4g}"
        return f"|g| {self.norm:.4g}, max {self.max_abs:.4g}{low}, non-finite {self.nonfinite}"


def flat_grads(params: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """All gradients as one new fp32 vector (a copy), or None when there are none."""
    grads = [p.grad for p in params if p.grad is not None]
    # One call that views and concatenates in C++ (as DDP's buckets do), not one op per tensor.
    return _flatten_dense_tensors(grads).float() if grads else None


def grad_stats(params: Sequence[torch.Tensor]) -> GradStats | None:
    """Norm, extremes and non-finite count of the gradients of params (None if no gradients)."""
    return stats_of(flat_grads(params))


def stats_of(flat: torch.Tensor | None, smallest: bool = False) -> GradStats | None:
    """GradStats of a flat gradient vector; the smallest nonzero |g| only when asked (costly)."""
    return measure(flat, smallest)[0]


def measure(flat: torch.Tensor | None, smallest: bool = False,
            flags: Sequence[torch.Tensor] = ()) -> tuple[GradStats | None, list[float]]:
    """GradStats of flat and the values of `flags` (e.g. found_inf), read back together."""
    if flat is None or flat.numel() == 0:
        stats = None if flat is None else GradStats(0.0, 0.0, 0.0 if smallest else None, 0, 0)
        return stats, [float(f) for f in flags]
    # aminmax is one cheap pass (the inf-norm is several times slower on CPU); max |g| is then
    # max(|min|, |max|), exact.
    magnitude = flat.abs() if smallest else flat
    lo, hi = torch.aminmax(magnitude)
    norm, lo, hi, *values = _read([torch.linalg.vector_norm(flat), lo, hi, *flags])
    if math.isfinite(lo) and math.isfinite(hi):
        top, nonfinite = max(abs(lo), abs(hi)), 0
    else:  # rare path: count the inf/NaN and look past them
        magnitude = magnitude if smallest else flat.abs()
        finite = torch.isfinite(magnitude)
        nonfinite = int(finite.logical_not().sum().item())
        magnitude = magnitude.where(finite, 0.0)
        lo, top = _read(list(torch.aminmax(magnitude)))
    low = None
    if smallest:  # lo is min |g|: the answer unless some gradient is exactly zero
        low = lo if lo > 0 or top == 0 else _min_nonzero(magnitude)
    return GradStats(norm, top, low, nonfinite, flat.numel()), values


def _read(scalars: list[torch.Tensor]) -> list[float]:
    """One-element tensors as floats: one stacked transfer from a GPU, plain reads on CPU."""
    if scalars[0].device.type == "cpu":  # nothing to sync; a stack would be one more op
        return [t.item() for t in scalars]
    first = scalars[0]
    with torch.no_grad():  # a scalar may be a loss that requires grad: no graph for a read
        same = [t if (t.shape, t.dtype, t.device) == (first.shape, first.dtype, first.device)
                else t.reshape(first.shape).to(first.device, first.dtype) for t in scalars]
        return torch.stack(same).tolist()


def _min_nonzero(magnitude: torch.Tensor) -> float:
    # where() rather than boolean indexing: no data-dependent shapes.
    return magnitude.where(magnitude > 0, float("inf")).amin().item()


@dataclass(frozen=True)
class StageRecord:
    """What one stage did: the loss or gradients it left, the scale, and a plain-words note."""

    step: int
    micro_step: int | None
    stage: str
    scale: float
    loss: float | None = None
    grads: GradStats | None = None
    found_inf: bool | None = None
    skipped: bool | None = None
    note: str = ""

    def summary(self) -> str:
        micro = "" if self.micro_step is None else f", micro-step {self.micro_step}"
        where = f"step {self.step}{micro}:"
        parts = [f"{where} {self.stage}", f"scale {format_scale(self.scale)}"]
        if self.loss is not None:
            parts.append(f"loss {self.loss:.6g}")
        if self.grads is not None:
            parts.append(self.grads.summary())
        if self.found_inf is not None:
            parts.append(f"found_inf {self.found_inf}")
        if self.skipped is not None:
            parts.append(f"skipped {self.skipped}")
        return " | ".join(parts) + (f" -- {self.note}" if self.note else "")

    __str__ = summary


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step: its micro-step losses, the scale before and after, skip or not."""

    step: int
    losses: tuple[float, ...]
    scale: float
    new_scale: float
    growth_tracker: int
    found_inf: bool
    skipped: bool
    grad_norm_scaled: float
    grad_norm_unscaled: float
    grad_norm_clipped: float
    clipped: bool
    injected: str = ""
    # inf/NaN weight values after a step whose gradients held inf/NaN (0 when they held none):
    # without a GradScaler nothing skips such a step, and this says what it did to the weights.
    nonfinite_weights: int = 0

    @property
    def loss(self) -> float:
        """The step's loss as nanoGPT logs it: the mean over its micro-steps."""
        return sum(self.losses) / len(self.losses)


def format_scale(scale: float) -> str:
    """A scale as a number and, when it is one, as a power of two (scales usually are)."""
    if scale > 0 and math.isfinite(scale):
        mant, exp = math.frexp(scale)
        if mant == 0.5:
            return f"{scale:g} (2^{exp - 1})"
    return f"{scale:g}"


def history_table(history: Sequence[StepRecord], last: int | None = None) -> Table:
    """The step records as a deterministic table (the last `last` rows when given)."""
    rows = [
        (r.step, f"{r.loss:.5g}", format_scale(r.scale), format_scale(r.new_scale),
         r.growth_tracker, r.found_inf, r.skipped, f"{r.grad_norm_scaled:.4g}",
         f"{r.grad_norm_unscaled:.4g}", "yes" if r.clipped else "no", r.injected or "-",
         r.nonfinite_weights)
        for r in (history if last is None else history[-last:])
    ]
    headers = ("step", "loss", "scale", "new scale", "growth tracker", "found_inf", "skipped",
               "|g| scaled", "|g| unscaled", "clipped", "injected", "non-finite weights")
    return Table(headers, rows, caption="GradScaler history (one row per optimizer step)")
