"""Loss curves of fp32 Adam vs 8-bit Adam (ampnb.lowbit.compare_optimizers)."""

from __future__ import annotations

from typing import Any

import torch
from matplotlib.axes import Axes

from ampnb.plots._axes import new_axes


def plot_optimizer_losses(result: Any, ax: Axes | None = None, smooth: int = 10) -> Axes:
    """Loss per step of each optimizer run, smoothed by a running mean, side by side."""
    ax = new_axes(ax, figsize=(7.0, 3.0))
    for i, (run, losses) in enumerate(result.losses.items()):
        t = torch.tensor(losses, dtype=torch.float64)
        k = max(1, min(smooth, len(losses)))
        mean = torch.nn.functional.avg_pool1d(t[None, None], k, stride=1)[0, 0]
        ax.plot(range(k - 1, len(losses)), mean.tolist(), color=f"C{i}", label=run,
                lw=1.5, ls=("-", "--", ":")[i % 3])
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss (running mean of {smooth})")
    ax.set_title("same model, same batches: Adam state in 32 vs 8 bits")
    ax.legend(fontsize=8)
    return ax
