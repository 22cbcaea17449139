"""The what-if's heat map: layer x format, the worst of the layer's tensors in each cell."""

from __future__ import annotations

import math
from typing import Any

from matplotlib.axes import Axes

from ampnb.plots._axes import new_axes

_LABELS = {"sqnr_db": "SQNR (dB)", "underflow": "share flushed to zero",
           "overflow": "share past the max"}


def plot_what_if(result: Any, stat: str = "sqnr_db", tensors: tuple[str, ...] | None = None,
                 ax: Axes | None = None) -> Axes:
    """Cells: the lowest SQNR (or largest share lost) over the layer's chosen tensors."""
    if stat not in _LABELS:
        raise ValueError(f"stat={stat!r} is not allowed; allowed: {', '.join(_LABELS)}")
    chosen = tensors or tuple(dict.fromkeys(r.tensor for r in result.rows))
    modules, fmts = result.modules, result.formats
    grid = [[result.value(m, f, stat, chosen) for f in fmts] for m in modules]
    finite = [v for row in grid for v in row if math.isfinite(v)]
    top = max(finite, default=1.0)
    shown = [[v if math.isfinite(v) else (top if v > 0 else math.nan) for v in row] for row in grid]
    ax = new_axes(ax, figsize=(1.0 * len(fmts) + 2.5, 0.32 * len(modules) + 1.6))
    cmap = "viridis" if stat == "sqnr_db" else "magma_r"
    image = ax.imshow(shown, aspect="auto", cmap=cmap)
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            text = "inf" if v == math.inf else (f"{v:.0f}" if stat == "sqnr_db" else f"{100 * v:.2g}%")
            ax.text(j, i, text, ha="center", va="center", fontsize=7, color="white")
    ax.set_xticks(range(len(fmts)), fmts, rotation=30, ha="right", fontsize=8)
    ax.set_yticks(range(len(modules)), modules, fontsize=7)
    ax.figure.colorbar(image, ax=ax, label=_LABELS[stat])
    ax.set_title(f"what if: {_LABELS[stat]} ({', '.join(chosen)}: the worst)", fontsize=9)
    return ax
