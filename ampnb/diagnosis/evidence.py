"""One row of per-mode evidence (speed, memory, accuracy, range) built from measured runs."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ampnb.diagnosis.candidates import Candidate
from ampnb.diagnosis.errors import rel
from ampnb.diagnosis.run import StepResult
from ampnb.instruments.coverage_stats import segment_counts

MIN_TIMED = 3  # fewer timed steps than this show no spread: no speed is claimed from them


@dataclass(frozen=True)
class ModeRow:
    """What one candidate (optionally with fp32 islands) measured on the same step."""

    name: str
    how: str
    native: bool
    keep_fp32: tuple[str, ...]
    seconds: float | None
    speedup: float | None
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    saved_bytes: int
    loss: float
    loss_error: float
    grad_error: float
    finite: bool
    nonfinite: str            # where inf/NaN first appeared ('' when none)
    nonfinite_module: str
    nonfinite_phase: str
    scale: float | None
    skipped: int
    first_overflow: str       # 16-mixed: what overflowed at the GradScaler's initial scale
    vanishing_updates: float | None   # true modes: share of 32-true's updates this step lost
    ratio: float | None = None        # 32-true's median step / this mode's, as measured
    ratio_spread: tuple[float, float] | None = None    # its low-high from the two spreads
    seconds_spread: tuple[float, float] | None = None  # this mode's step times, low-high
    measurable: bool = False          # the spreads do not overlap: faster or slower for sure
    noise: float | None = None        # 32-true's step-to-step variation measured here
    timed: int = 0                    # timed steps behind the ratio (each mode)
    ran: bool = True                  # False: a row for a mode that did not run (how says why)

    @classmethod
    def not_run(cls, name: str, why: str, keep: tuple[str, ...] = ()) -> ModeRow:
        """The row of a mode that did not run: no figures, `how` 'not run: <why>'."""
        nan = math.nan
        return cls(name, f"not run: {why}", False, keep, None, None, 0, 0, 0, 0, nan, nan, nan,
                   False, "", "", "", None, 0, "", None, ran=False)

    @property
    def speed(self) -> str:
        """The speed against 32-true with its spread, or 'no measurable difference'."""
        if self.ratio is None:
            return "-"
        slower = f" = {1 / self.ratio:.1f}x slower" if self.measurable and self.ratio < 1 else ""
        if self.ratio_spread:
            spread = f" ({self.ratio_spread[0]:.2f}-{self.ratio_spread[1]:.2f}x{slower})"
        else:
            steps = f"{self.timed} timed step{'s' if self.timed != 1 else ''} each"
            var = "" if self.noise is None else f"the {self.noise:.0%} step-to-step variation " \
                                                "measured here"
            spread = (f" ({steps}{slower}: a gap larger than {var})" if self.measurable else
                      f" (fewer than {MIN_TIMED} timed steps: no spread" +
                      (f"; within {var})" if var else ")"))
        return (f"{self.ratio:.2f}x{spread}" if self.measurable
                else f"no measurable difference{spread}")

    @property
    def label(self) -> str:
        return self.name + (f" + keep_fp32({', '.join(self.keep_fp32)})" if self.keep_fp32 else "")

    @property
    def memory_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.saved_bytes


# Gradient elements scaled at a time for the underflow count: the copy stays small on any model
SCALED_AT_ONCE = 1 << 22


def underflow(grads: Mapping[str, torch.Tensor], scale: float) -> float:
    """Fraction of nonzero gradient values that round to zero in fp16 at a loss scale, counted
    in runs of tensors (segment_counts: a few torch calls per run, not per tensor; a real model
    has hundreds of them, and the doctor's budget pays for every pass)."""
    flushed = nonzero = 0
    items = [g for g in grads.values() if g.numel()]
    run: list[torch.Tensor] = []
    for i, g in enumerate(items):
        run.append(g.detach().reshape(-1).float() * scale)
        if i + 1 < len(items) and sum(t.numel() for t in run) < SCALED_AT_ONCE:
            continue
        counts = segment_counts(run, ["fp16"])
        for j in range(len(run)):
            found = counts.coverages(j)["fp16"]
            flushed, nonzero = flushed + found.n_underflow, nonzero + found.count - found.n_zero
        run = []
    return flushed / nonzero if nonzero else 0.0


def spread(times: list[float] | None) -> tuple[float, float] | None:
    """Low-high of step times: the interquartile range from 5 steps, min-max below that (too
    few for quartiles); None below MIN_TIMED steps (no spread to judge noise by)."""
    if not times or len(times) < MIN_TIMED or min(times) <= 0:
        return None
    if len(times) < 5:
        return min(times), max(times)
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return q1, q3


def speed(times: list[float] | None, ref_times: list[float] | None, noise: float | None = None
          ) -> tuple[float | None, float | None, tuple[float, float] | None, bool]:
    """(speedup the spread supports, measured median ratio, its low-high, measurable). With too
    few steps for a spread, a gap larger than `noise` (32-true's measured step-to-step
    variation) is measurable."""
    seconds = statistics.median(times) if times else None
    ref_s = statistics.median(ref_times) if ref_times else None
    if not seconds or not ref_s:
        return None, None, None, False
    ratio = ref_s / seconds
    mine, ref = spread(times), spread(ref_times)
    if mine is None or ref is None:
        if noise is not None and abs(math.log(ratio)) > math.log1p(noise):
            return ratio, ratio, None, True
        return 1.0, ratio, None, False
    low, high = ref[0] / mine[1], ref[1] / mine[0]
    # Faster (slower) only when the spreads do not overlap: the mode's slow end (upper quartile)
    # beats 32-true's fast end (lower quartile), or the reverse; else noise could explain it.
    measurable = low > 1 or high < 1
    return (ratio if measurable else 1.0), ratio, (low, high), measurable


def mode_row(cand: Candidate, run: StepResult, ref: StepResult, times: list[float] | None,
             ref_times: list[float] | None, keep: tuple[str, ...] = (), *,
             noise: float | None = None) -> ModeRow:
    """The evidence row of one run against the reference (`ref_times` timed round-robin with
    `times`); `speedup` is the measured ratio when measurable, 1.0 when noise could explain it."""
    seconds = statistics.median(times) if times else None
    speedup, ratio, ratio_spread, measurable = speed(times, ref_times, noise)
    # inf/NaN in the loss, forward or gradients: where the hunter found it; else in the weights
    nf = run.nonfinite if not run.step_finite else None
    message, module, phase = (nf.message, _module(nf.module), nf.phase) if nf else (
        (run.weights_cause, "", "optimizer step") if run.bad_weights else ("", "", ""))
    first = run.first_overflow
    return ModeRow(
        cand.name, cand.how, cand.native, keep, seconds, speedup, run.param_bytes, run.grad_bytes,
        run.optimizer_bytes, run.saved_bytes, run.loss, rel(run.loss, ref.loss),
        run.grad_error, run.finite, message, module, phase, run.scale,
        run.skipped, first.message if first else "", run.lost_updates, ratio, ratio_spread,
        spread(times), measurable, noise, min(len(times or ()), len(ref_times or ())))


def _module(path: str) -> str:
    """The hunter names the outermost module by its class; module paths start below it."""
    return "" if "." not in path and path[:1].isupper() else path


def acceptable(row: ModeRow, loss_tol: float, grad_tol: float) -> bool:
    """Finite, and loss and gradient errors within tolerance."""
    return (row.finite and row.loss_error <= loss_tol
            and (math.isnan(row.grad_error) or row.grad_error <= grad_tol))
