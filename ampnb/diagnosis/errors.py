"""Error figures between a run and its reference: relative L2 error and SQNR, as torchao names them."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Err:
    """Relative L2 error and SQNR (dB) of one tensor against its reference; nan: not comparable."""

    rel: float
    sqnr_db: float

    @property
    def text(self) -> str:
        """'3.1e-03 (50 dB)', 'inf/NaN' or '-'."""
        if math.isnan(self.rel):
            return "-"
        if math.isinf(self.rel):
            return "inf/NaN"
        return f"{self.rel:.1e} ({self.sqnr_db:.0f} dB)"


NOT_COMPARED = Err(math.nan, math.nan)


def flat(ts: list[torch.Tensor]) -> torch.Tensor:
    """Floating tensors flattened into one float64 vector (empty when there are none)."""
    found = [t.detach().reshape(-1).double() for t in ts if t.is_floating_point()]
    return torch.cat(found) if found else torch.zeros(0, dtype=torch.float64)


def compare(got: torch.Tensor, ref: torch.Tensor) -> Err:
    """||got - ref|| / ||ref|| and 20 log10(||ref|| / ||got - ref||); inf when got is not finite."""
    if got.shape != ref.shape or ref.numel() == 0:
        return NOT_COMPARED
    got, ref = got.double(), ref.double()
    if not bool(torch.isfinite(got).all()):
        return Err(math.inf, -math.inf)
    ref = torch.where(torch.isfinite(ref), ref, got)  # the reference's own inf/NaN compare equal
    signal = float(torch.linalg.vector_norm(ref))
    noise = float(torch.linalg.vector_norm(got - ref))
    if noise == 0:
        return Err(0.0, math.inf)
    if signal == 0:
        return Err(math.inf, -math.inf)
    return Err(noise / signal, 20 * math.log10(signal / noise))


def rel(a: float, b: float) -> float:
    """|a - b| / |b| for scalars (inf when a is not finite)."""
    if not math.isfinite(a):
        return math.inf
    return abs(a - b) / abs(b) if b else abs(a - b)


def headroom(amax: float, fmt_max: float) -> float:
    """Binades between a tensor's largest magnitude and a format's max (negative: it overflows)."""
    if not amax or math.isnan(amax):
        return math.inf
    return math.log2(fmt_max / amax)


def lost_updates(ref_before: dict[str, torch.Tensor], ref_after: dict[str, torch.Tensor],
                 before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    """Share of the reference's nonzero weight updates whose weight this run left unchanged."""
    lost = moved_total = 0
    for n, w in ref_before.items():
        if n not in before or n not in after or before[n].shape != w.shape or \
                not w.is_floating_point():
            continue
        moved = ref_after[n] != w
        lost += int((moved & (after[n] == before[n])).sum())
        moved_total += int(moved.sum())
    return lost / moved_total if moved_total else 0.0
