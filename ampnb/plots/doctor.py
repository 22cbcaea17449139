"""The doctor's per-layer plot: activation headroom and local error per module."""

from __future__ import annotations

import math
from typing import Any

from matplotlib.axes import Axes

from ampnb.plots._axes import new_axes


def plot_layers(report: Any, mode: str | None = None, ax: Axes | None = None,
                limit: int = 40) -> Axes:
    """Bars: headroom (binades to the format's max) per leaf module; dots: local error (right axis)."""
    rows = [r for r in report.layers if r.leaf][:limit]
    if mode is None:
        low = report.low_precision
        mode = low.mode if low is not None else next(
            (r.name for r in report.modes[1:] if not r.keep_fp32), report.modes[0].name)
    ax = new_axes(ax, figsize=(max(6.0, 0.35 * len(rows) + 2), 3.4))
    fmts = list(rows[0].headroom) if rows else []
    x = range(len(rows))
    width = 0.8 / max(1, len(fmts))
    for k, f in enumerate(fmts):
        vals = [r.headroom[f] if math.isfinite(r.headroom[f]) else 0.0 for r in rows]
        ax.bar([i + k * width for i in x], vals, width=width, label=f"headroom {f}",
               color=["tab:red" if v < 0 else f"C{k}" for v in vals])
    ax.axhline(0, color="black", lw=0.8)
    ax.set_ylabel("headroom (binades)")
    ax.set_xticks(list(x), [r.module for r in rows], rotation=60, ha="right", fontsize=7)
    twin = ax.twinx()
    errs = [r.local.get(mode) for r in rows]
    pts = [(i, e.rel) for i, e in enumerate(errs) if e is not None and math.isfinite(e.rel)
           and e.rel > 0]
    if pts:
        twin.scatter(*zip(*pts), color="black", marker="o", s=14, label=f"local error {mode}")
        twin.set_yscale("log")
    twin.set_ylabel(f"local rel. error ({mode})")
    ax.legend(loc="upper left", fontsize=7)
    ax.set_title(f"per layer: headroom and local error ({mode})", fontsize=9)
    return ax
