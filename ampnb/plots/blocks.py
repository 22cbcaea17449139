"""Block-scaled formats drawn: each block's flushed share beside tensorwise FP8's, and a
tensor's histogram against the element format shifted by its blocks' scales."""

from __future__ import annotations

import math
from typing import Any

import torch
from matplotlib.axes import Axes

from ampnb.plots._axes import new_axes
from ampnb.whatif.blocks import block_stats


def plot_block_flush(x: torch.Tensor, fmt: str = "mxfp8_e4m3", ax: Axes | None = None) -> Axes:
    """Bars per block: the share of its nonzero values flushed to zero, block-scaled vs FP8
    e4m3 scaled per tensor (one outlier costs the whole tensor there, one block here)."""
    s = block_stats(x, fmt)
    ax = new_axes(ax, figsize=(8.0, 2.8))
    n = range(len(s.flushed))
    ax.bar([i - 0.2 for i in n], [100 * v for v in s.flushed_tensorwise], width=0.4,
           color="tab:red", label="fp8_e4m3, one scale per tensor")
    ax.bar([i + 0.2 for i in n], [100 * v for v in s.flushed], width=0.4, color="tab:blue",
           label=f"{s.format}, one scale per {s.block_size} values")
    ax.set_xlabel(f"block ({s.block_size} values along the last dim)")
    ax.set_ylabel("flushed to zero (%)")
    ax.legend(fontsize=8, loc="upper right")
    ax.set_title("share of each block's nonzero values flushed to zero", fontsize=9)
    return ax


def plot_block_histogram(x: torch.Tensor, fmt: str = "mxfp8_e4m3", ax: Axes | None = None
                         ) -> Axes:
    """log2|x| histogram; a band per distinct block scale: the element format's range there."""
    s = block_stats(x, fmt)
    a = x.detach().float().abs().flatten()
    a = a[(a > 0) & torch.isfinite(a)]
    ax = new_axes(ax, figsize=(8.0, 3.0))
    lo_e, hi_e = s.element_binades
    scales = sorted({v for v in s.log2_scale if not math.isnan(v)})
    for k, sc in enumerate(scales):
        ax.axvspan(lo_e + sc, hi_e + sc, ymin=0, ymax=1, alpha=0.12, color=f"C{k % 10}", lw=0,
                   gid=f"{s.format}:block{k}")
    if a.numel():
        ax.hist(torch.log2(a).tolist(), bins=80, color="0.2")
    ax.set_yscale("log")
    ax.set_xlabel(f"log2 |x|   (bands: {s.format}'s element range at each of the "
                  f"{len(scales)} distinct block scales)")
    ax.set_ylabel("values")
    ax.set_title(f"{len(s.flushed)} blocks of {s.block_size}", fontsize=9)
    return ax


def plot_blocks(x: torch.Tensor, fmt: str = "mxfp8_e4m3", axes: Any = None) -> Any:
    """Both views, histogram above, flushed shares below; returns the two Axes."""
    if axes is None:
        fig_ax = new_axes(None, figsize=(8.0, 5.6), nrows=2)
        axes = (fig_ax, fig_ax.figure.add_subplot(2, 1, 2))
    plot_block_histogram(x, fmt, ax=axes[0])
    plot_block_flush(x, fmt, ax=axes[1])
    return axes
