"""The what-if's records, and its table: SQNR, underflow and overflow per layer, tensor and format."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ampnb.display import Table, TableView, format_percent

TENSORS = ("weight", "input", "grad_output")
STATS = ("sqnr_db", "underflow", "overflow")


@dataclass(frozen=True)
class WhatIfRow:
    """One layer's tensor in one format: SQNR in dB (inf: exact) and the shares lost."""

    module: str
    tensor: str  # weight | input | grad_output
    format: str
    sqnr_db: float
    underflow: float  # share of the values, nonzero before, zero after
    overflow: float  # share of the finite values that round past the max (inf or saturated)
    numel: int


def sqnr_db(signal: float, noise: float) -> float:
    """torchao's compute_error, 20*log10(||x|| / ||x - y||), from the two squared norms."""
    if noise == 0:
        return math.inf
    ratio = signal / noise  # 0 when the copy went to inf; NaN from a NaN
    return -math.inf if ratio == 0 else 10 * math.log10(ratio)


@dataclass(frozen=True, repr=False)
class WhatIf(TableView):
    """What one fp32 training step's tensors would lose in each format, layer by layer."""

    rows: tuple[WhatIfRow, ...]
    formats: tuple[str, ...]
    device: str = "cpu"

    @property
    def modules(self) -> tuple[str, ...]:
        """The layers in the order their forward first ran."""
        return tuple(dict.fromkeys(r.module for r in self.rows))

    def get(self, module: str, tensor: str, format: str) -> WhatIfRow:  # noqa: A002 - the field
        """The row of one layer, tensor and format (KeyError naming what exists)."""
        for r in self.rows:
            if (r.module, r.tensor, r.format) == (module, tensor, format):
                return r
        raise KeyError(f"no row {module!r}/{tensor!r}/{format!r}; modules: {self.modules}")

    def value(self, module: str, format: str, stat: str = "sqnr_db",  # noqa: A002
              tensors: tuple[str, ...] = TENSORS) -> float:
        """The worst of the tensors' values: the lowest SQNR, or the largest share lost."""
        vals = [getattr(r, stat) for r in self.rows
                if r.module == module and r.format == format and r.tensor in tensors]
        if not vals:
            return math.nan
        return min(vals) if stat == "sqnr_db" else max(vals)

    def table(self, stat: str = "sqnr_db") -> Table:
        """One row per layer and tensor, one column per format."""
        if stat not in STATS:
            raise ValueError(f"stat={stat!r} is not allowed; allowed: {', '.join(STATS)}")
        cells: dict[tuple[str, str], dict[str, Any]] = {}
        for r in self.rows:
            cells.setdefault((r.module, r.tensor), {})[r.format] = getattr(r, stat)
        show = _db if stat == "sqnr_db" else format_percent
        body = [(m, t, *(show(c[f]) if f in c else "-" for f in self.formats))
                for (m, t), c in cells.items()]
        what = {"sqnr_db": "SQNR (dB, higher is closer; inf: exact)",
                "underflow": "share flushed to zero", "overflow": "share past the max"}[stat]
        return Table(("layer", "tensor", *self.formats), body,
                     caption=f"What if: {what}, one fp32 training step on {self.device}",
                     notes=("SQNR as torchao's compute_error: 20 log10(||x|| / ||x - q(x)||). "
                            "Block-scaled formats along the last dimension (conv: channels).",))


def _db(v: float) -> str:
    return "inf" if v == math.inf else f"{v:.1f}"
