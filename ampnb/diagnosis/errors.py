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


CHUNK = 1 << 20  # elements per float64 pass: a logits tensor is compared without 4 copies of it


def _norms(got: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float, float]:
    """(got all finite, ||ref||^2, ||got - ref||^2) in float64, a chunk at a time; the
    reference's own inf/NaN compare equal. Squares of fp32 values cannot overflow float64, so
    finite sums mean finite chunks: the masks are computed only for a chunk whose sums are not."""
    got, ref = got.detach().reshape(-1), ref.detach().reshape(-1)
    signal = noise = 0.0
    for i in range(0, got.numel(), CHUNK):
        g, r = got[i:i + CHUNK].double(), ref[i:i + CHUNK].double()
        d = g - r
        s, n = float(torch.dot(r, r)), float(torch.dot(d, d))
        if not (math.isfinite(s) and math.isfinite(n)):  # inf/NaN in the chunk: the slow path
            if not bool(torch.isfinite(g).all()):
                return False, math.nan, math.nan
            r = torch.where(torch.isfinite(r), r, g)
            d = g - r
            s, n = float(torch.dot(r, r)), float(torch.dot(d, d))
        signal += s
        noise += n
    return True, signal, noise


def _err(signal: float, noise: float) -> Err:
    if noise == 0:
        return Err(0.0, math.inf)
    if signal == 0:
        return Err(math.inf, -math.inf)
    return Err(math.sqrt(noise / signal), 10 * math.log10(signal / noise))


def compare(got: torch.Tensor, ref: torch.Tensor) -> Err:
    """||got - ref|| / ||ref|| and 20 log10(||ref|| / ||got - ref||); inf when got is not finite."""
    if got.shape != ref.shape or ref.numel() == 0:
        return NOT_COMPARED
    finite, signal, noise = _norms(got, ref)
    return _err(signal, noise) if finite else Err(math.inf, -math.inf)


def rel(a: float, b: float) -> float:
    """|a - b| / |b| for scalars (inf when a is not finite)."""
    if not math.isfinite(a):
        return math.inf
    return abs(a - b) / abs(b) if b else abs(a - b)


def lost_updates(ref_before: dict[str, torch.Tensor], ref_after: dict[str, torch.Tensor],
                 before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    """Share of the reference's nonzero weight updates whose weight this run left unchanged."""
    return lost_share(moved(ref_before, ref_after), before, after)


class Total:
    """The relative L2 error of many tensors together, accumulated one pair at a time (what
    `compare` of their concatenation gives, without holding the concatenation)."""

    def __init__(self) -> None:
        self.signal = self.noise = 0.0
        self.finite = True
        self.count = 0

    def add(self, got: torch.Tensor, ref: torch.Tensor) -> Err:
        """Add one pair; returns its own error."""
        if got.shape != ref.shape or ref.numel() == 0:
            return NOT_COMPARED
        self.count += 1
        finite, signal, noise = _norms(got, ref)
        if not finite:
            self.finite = False
            return Err(math.inf, -math.inf)
        self.signal += signal
        self.noise += noise
        return _err(signal, noise)

    @property
    def err(self) -> Err:
        """The error of everything added (inf when any tensor was not finite)."""
        if not self.finite:
            return Err(math.inf, -math.inf)
        return _err(self.signal, self.noise) if self.count else NOT_COMPARED


def moved(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]
          ) -> dict[str, torch.Tensor]:
    """Which entries of each floating weight a step changed (one byte per entry)."""
    return {n: after[n] != w.to(after[n].device, after[n].dtype) for n, w in before.items()
            if n in after and w.is_floating_point() and after[n].shape == w.shape}


def lost_share(moved_by_ref: dict[str, torch.Tensor], before: dict[str, torch.Tensor],
               after: dict[str, torch.Tensor]) -> float:
    """Share of the entries the reference's step moved that this run's step left unchanged."""
    lost = total = 0
    for n, m in moved_by_ref.items():
        if n in before and n in after and before[n].shape == m.shape:
            lost += int((m & (after[n] == before[n])).sum())
            total += int(m.sum())
    return lost / total if total else 0.0
