"""Choosing the mode: tolerance, fp32 islands (chosen, then verified), and the recommendation."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from ampnb.diagnosis.evidence import ModeRow, acceptable
from ampnb.diagnosis.layers import LayerRow
from ampnb.display import format_bytes

SPEEDUP_MIN = 1.1   # a measurable speedup (spreads apart, see evidence.speed) must reach this too
ISLAND_MODES = {"bf16-mixed": "bf16", "16-mixed": "fp16", "bf16-true": "bf16", "16-true": "fp16"}
PREFERENCE = ("bf16-mixed", "16-mixed", "transformer-engine", "bf16-true", "16-true")
MAX_ISLANDS = 8
MAX_ROUNDS = 3
LOCAL_OUTLIER = 10.0  # a layer is sensitive when its local error is 10x the mode's median


@dataclass(frozen=True)
class Tolerance:
    """Largest relative loss error and relative gradient error (L2, all parameters) accepted."""

    loss: float = 1e-2
    grad: float = 1e-1

    @classmethod
    def of(cls, value: object) -> Tolerance:
        """None (defaults), one number for both, a (loss, grad) pair, a dict or a Tolerance."""
        if value is None:
            return cls()
        if isinstance(value, Tolerance):
            return value
        try:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                found = cls(float(value), float(value))
            elif isinstance(value, dict):
                found = cls(**{k: float(v) for k, v in value.items()})
            else:
                loss, grad = value  # type: ignore[misc]
                found = cls(float(loss), float(grad))
        except (TypeError, ValueError):
            found = None
        if found is None or not (found.loss > 0 and found.grad > 0):
            raise ValueError(f"tolerance={value!r} is not allowed; allowed: a positive number, "
                             "a (loss, grad) pair or {'loss': ..., 'grad': ...}")
        return found


@dataclass(frozen=True)
class Recommendation:
    """The mode to use, modules to keep in fp32, why (with the figures), and code."""

    mode: str
    keep_fp32: tuple[str, ...]
    reasons: tuple[str, ...]
    code: str
    before: ModeRow | None = None   # the mode without islands, when islands were needed
    after: ModeRow | None = None    # the verified re-run with the islands
    tf32: bool = False

    @property
    def headline(self) -> str:
        keep = f" with {', '.join(self.keep_fp32)} kept in fp32" if self.keep_fp32 else ""
        return f"{self.mode}{' + TF32' if self.tf32 else ''}{keep}"

    def __repr__(self) -> str:
        return "\n".join([f"recommended: {self.headline}", *(f"- {r}" for r in self.reasons)])


def sites(row: ModeRow, layers: tuple[LayerRow, ...], fmt: str, grad_tol: float) -> list[str]:
    """Modules to keep in fp32: where inf/NaN appeared and leaves past the format's max; when
    the run was finite, the leaves whose local error stands out (10x the mode's median)."""
    if not row.finite:
        found = [row.nonfinite_module] if row.nonfinite_module else []
        found += [r.module for r in layers if r.leaf and r.headroom.get(fmt, math.inf) < 0]
        return [m for m in dict.fromkeys(found) if m]
    errs = [r.local[row.name].rel for r in layers if row.name in r.local
            and math.isfinite(r.local[row.name].rel)]
    if not errs:
        return []
    limit = max(grad_tol, LOCAL_OUTLIER * statistics.median(errs))
    return [r.module for r in layers if row.name in r.local and r.local[row.name].rel > limit]


def islands(row: ModeRow, layers: tuple[LayerRow, ...], tol: Tolerance,
            rerun: Callable[[tuple[str, ...]], ModeRow]) -> ModeRow | None:
    """Add fp32 islands round by round and re-run until the mode is acceptable (None: no fix)."""
    fmt = ISLAND_MODES.get(row.name)
    if fmt is None or acceptable(row, tol.loss, tol.grad):
        return None
    keep: tuple[str, ...] = ()
    current = row
    for _ in range(MAX_ROUNDS):
        new = [m for m in sites(current, layers, fmt, tol.grad) if m not in keep]
        if not new or len(keep) + len(new) > MAX_ISLANDS:
            break
        keep = (*keep, *new)
        current = rerun(keep)
        if acceptable(current, tol.loss, tol.grad):
            return current
    return current if keep else None


def _lost(row: ModeRow) -> str:
    return (f"{row.vanishing_updates:.1%} of the weight updates 32-true makes in this step leave "
            f"the {row.name} weights unchanged (smaller than half a unit in their last place): "
            "they are lost")


def _why_not(row: ModeRow, tol: Tolerance) -> str:
    if not row.finite:
        return f"{row.label}: inf/NaN ({row.nonfinite or 'in the gradients'})"
    lost = f"; {_lost(row)}" if row.vanishing_updates else ""
    return (f"{row.label}: loss error {row.loss_error:.1e} (tolerance {tol.loss:g}), gradient "
            f"error {row.grad_error:.1e} (tolerance {tol.grad:g}){lost}")


def _speed(row: ModeRow) -> str:
    return row.speed


def choose(rows: list[ModeRow], tol: Tolerance, code: Callable[[str, tuple[str, ...], bool], str],
           ) -> tuple[Recommendation, Recommendation | None]:
    """(recommendation for this machine, best low-precision choice elsewhere or None)."""
    ref = rows[0]
    ok = [r for r in rows[1:] if acceptable(r, tol.loss, tol.grad)]
    fast = [r for r in ok if r.native and r.measurable and r.speedup is not None
            and r.speedup >= SPEEDUP_MIN]
    lowp = [r for r in ok if r.name in PREFERENCE]
    lowp.sort(key=lambda r: (PREFERENCE.index(r.name), len(r.keep_fp32)))
    rejected = [_why_not(r, tol) for r in rows[1:] if r not in ok and not any(
        o.name == r.name for o in ok)]
    best_low = _make(lowp[0], ref, rows, tol, code) if lowp else None
    if fast:
        pick = max(fast, key=lambda r: (r.speedup, -len(r.keep_fp32)))
        return _make(pick, ref, rows, tol, code, rejected), (
            None if best_low is None or best_low.mode == pick.name else best_low)
    slow = [f"{r.label}: {_speed(r)} ({r.how})" for r in rows[1:] if r in ok]
    reasons = [f"nothing that stays within tolerance is measurably faster than 32-true on this "
               f"machine (counted: native units, at least {SPEEDUP_MIN}x, and the mode's slow end "
               "of step times below 32-true's fast end, timed round-robin)", *slow,
               *rejected]
    return (Recommendation("32-true", (), tuple(reasons), code("32-true", (), False)), best_low)


def _make(row: ModeRow, ref: ModeRow, rows: list[ModeRow], tol: Tolerance,
          code: Callable[[str, tuple[str, ...], bool], str], rejected: list[str] = ()
          ) -> Recommendation:
    tf32 = row.name.endswith("+tf32")
    mode = "32-true" if tf32 else row.name
    reasons = [f"{row.label}: {_speed(row)} vs 32-true ({row.how}), loss error "
               f"{row.loss_error:.1e} <= {tol.loss:g}, gradient error {row.grad_error:.1e} <= "
               f"{tol.grad:g}, no inf/NaN",
               f"memory {format_bytes(row.memory_bytes)} vs {format_bytes(ref.memory_bytes)} in "
               "32-true (parameters, gradients, optimizer state, saved for backward)"]
    before = None
    if row.keep_fp32:
        before = next(r for r in rows if r.name == row.name and not r.keep_fp32)
        reasons.append(f"verified: without the islands {_why_not(before, tol)}; with them "
                       f"loss error {row.loss_error:.1e}, gradient error {row.grad_error:.1e}, "
                       f"{'no inf/NaN' if row.finite else 'still inf/NaN'}")
    if row.vanishing_updates:
        reasons.append(_lost(row))
    return Recommendation(mode, row.keep_fp32, (*reasons, *rejected), code(mode, row.keep_fp32, tf32),
                          before, row if row.keep_fp32 else None, tf32)
