"""One row of per-mode evidence (speed, memory, accuracy, range) built from measured runs."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch

from ampnb.doctor.candidates import Candidate
from ampnb.doctor.errors import compare, flat, rel
from ampnb.doctor.run import StepResult
from ampnb.formats import get_format
from ampnb.instruments.coverage_stats import coverage


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
    vanishing_updates: float | None   # true modes: updates smaller than half an ulp of the weight

    @property
    def label(self) -> str:
        return self.name + (f" + keep_fp32({', '.join(self.keep_fp32)})" if self.keep_fp32 else "")

    @property
    def memory_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.saved_bytes


def grad_error(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """Relative L2 error of all gradients together (inf when any is not finite)."""
    names = [n for n in ref if n in got and got[n].shape == ref[n].shape]
    return compare(flat([got[n] for n in names]), flat([ref[n] for n in names])).rel


def per_param(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Relative gradient error per parameter."""
    return {n: compare(got[n].reshape(-1), ref[n].reshape(-1)).rel
            for n in ref if n in got and got[n].shape == ref[n].shape}


def vanishing(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor],
              dtype: torch.dtype) -> float:
    """Fraction of the reference's nonzero weight updates smaller than half an ulp in dtype."""
    fmt = get_format(dtype)
    lost = total = 0
    for n, w in before.items():
        if n not in after or not w.is_floating_point():
            continue
        u = (after[n].double() - w.double()).reshape(-1)
        w = w.double().reshape(-1)
        _, e = torch.frexp(w)  # |w| = m * 2**e with 0.5 <= m < 1
        ulp = torch.where(w == 0, torch.full_like(w, fmt.smallest_subnormal),
                          torch.ldexp(torch.ones_like(w), e - 1 - fmt.mantissa_bits))
        ulp = ulp.clamp(min=fmt.smallest_subnormal)
        moved = u != 0
        lost += int((moved & (u.abs() < ulp / 2)).sum())
        total += int(moved.sum())
    return lost / total if total else 0.0


def underflow(grads: dict[str, torch.Tensor], scale: float) -> float:
    """Fraction of nonzero gradient values that round to zero in fp16 at a loss scale."""
    vals = flat(list(grads.values())).float() * scale
    vals = vals[vals != 0]
    return coverage(vals, "fp16").underflow if vals.numel() else 0.0


def mode_row(cand: Candidate, run: StepResult, ref: StepResult, times: list[float] | None,
             ref_seconds: float | None, keep: tuple[str, ...] = ()) -> ModeRow:
    """The evidence row of one run against the reference."""
    seconds = statistics.median(times) if times else None
    speedup = ref_seconds / seconds if seconds and ref_seconds else None
    m = cand.mode
    true_low = not m.is_mixed and m.param_dtype in (torch.float16, torch.bfloat16)
    nf = run.nonfinite if not run.finite else None  # the hunter's site matters when it broke
    first = run.first_overflow
    return ModeRow(
        cand.name, cand.how, cand.native, keep, seconds, speedup, run.param_bytes, run.grad_bytes,
        run.optimizer_bytes, run.saved_bytes, run.loss, rel(run.loss, ref.loss),
        grad_error(run.grads, ref.grads), run.finite, nf.message if nf else "",
        _module(nf.module) if nf else "", nf.phase if nf else "", run.scale, run.skipped,
        first.message if first else "",
        vanishing(ref.before, ref.after, m.param_dtype) if true_low and ref.before else None)


def _module(path: str) -> str:
    """The hunter names the outermost module by its class; module paths start below it."""
    return "" if "." not in path and path[:1].isupper() else path


def acceptable(row: ModeRow, loss_tol: float, grad_tol: float) -> bool:
    """Finite, and loss and gradient errors within tolerance."""
    return (row.finite and row.loss_error <= loss_tol
            and (math.isnan(row.grad_error) or row.grad_error <= grad_tol))
