"""The error of an N-rank gradient all-reduce against N, per reduce format and order."""

from __future__ import annotations

from typing import Any

from matplotlib.axes import Axes

from ampnb.formats import get_format
from ampnb.plots._axes import new_axes

_COLORS = {"fp32": "C0", "bf16": "C3", "fp16": "C2"}


def plot_reduction_error(sweep: Any, ax: Axes | None = None) -> Axes:
    """Relative error of the reduced mean vs ranks (log-log), with each format's eps/2 marked."""
    ax = new_axes(ax, figsize=(7.0, 3.8))
    for (fmt, order, pre), (ns, errs) in sweep.series().items():
        style = "-" if order == "ring" else "--"
        label = f"{fmt}{' ÷N first' if pre else ''}, {order}"
        ax.plot(ns, errs, style, marker="o" if not pre else "x", markersize=3,
                color=_COLORS.get(fmt, "C7"), alpha=0.6 if pre else 1.0, label=label)
    for fmt in dict.fromkeys(k[0] for k in sweep.series()):
        ax.axhline(get_format(fmt).eps / 2, color=_COLORS.get(fmt, "C7"), lw=0.6, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks N")
    ax.set_ylabel("relative error of the reduced mean")
    ax.set_title("summing N ranks' gradients, rounded after every addition (dotted: eps/2)")
    ax.legend(fontsize=7, ncol=2)
    return ax
