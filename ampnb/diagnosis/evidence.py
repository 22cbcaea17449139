"""One row of per-mode evidence (speed, memory, accuracy, range) built from measured runs."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch

from ampnb.diagnosis.candidates import Candidate
from ampnb.diagnosis.errors import compare, flat, rel
from ampnb.diagnosis.run import StepResult
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
    vanishing_updates: float | None   # true modes: share of 32-true's updates this step lost

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
    # inf/NaN in the loss, forward or gradients: where the hunter found it; else in the weights
    nf = run.nonfinite if not run.step_finite else None
    message, module, phase = (nf.message, _module(nf.module), nf.phase) if nf else (
        (run.weights_cause, "", "optimizer step") if run.bad_weights else ("", "", ""))
    first = run.first_overflow
    return ModeRow(
        cand.name, cand.how, cand.native, keep, seconds, speedup, run.param_bytes, run.grad_bytes,
        run.optimizer_bytes, run.saved_bytes, run.loss, rel(run.loss, ref.loss),
        grad_error(run.grads, ref.grads), run.finite, message, module, phase, run.scale,
        run.skipped, first.message if first else "", run.lost_updates)


def _module(path: str) -> str:
    """The hunter names the outermost module by its class; module paths start below it."""
    return "" if "." not in path and path[:1].isupper() else path


def acceptable(row: ModeRow, loss_tol: float, grad_tol: float) -> bool:
    """Finite, and loss and gradient errors within tolerance."""
    return (row.finite and row.loss_error <= loss_tol
            and (math.isnan(row.grad_error) or row.grad_error <= grad_tol))
