"""FP8 and low-bit pictures: where scaled tensors land in e4m3/e5m2, code grids, loss curves."""

from __future__ import annotations

import math
from typing import Any

import torch
from matplotlib.axes import Axes

from ampnb.formats import get_format
from ampnb.lowbit.formats import block_normalized, get_lowbit
from ampnb.plots._axes import new_axes


def plot_fp8_scaling(stats: Any, layer: str, role: str = "input", ax: Axes | None = None) -> Axes:
    """Per step, log2 of amax × scale (where the largest value landed) against the format's range."""
    records = stats.series(layer, role)
    if not records:
        raise ValueError(f"no {role!r} casts recorded for layer {layer!r}; layers: "
                         f"{', '.join(stats.layers)}; roles: input, weight, grad_output")
    fmt = get_format(records[0].format)
    ax = new_axes(ax, figsize=(7.0, 3.0))
    steps = [r.step for r in records]
    landed = [math.log2(r.scaled_amax) if r.scaled_amax > 0 else float("nan") for r in records]
    for value, label, style in ((fmt.max, f"max {fmt.max:g}", "-"),
                                (fmt.smallest_normal, "smallest normal", "--"),
                                (fmt.smallest_subnormal, "smallest subnormal", ":")):
        ax.axhline(math.log2(value), color="0.4", ls=style, lw=1)
        ax.annotate(f"{fmt.name} {label}", (0, math.log2(value)), xycoords=("axes fraction", "data"),
                    xytext=(2, 2), textcoords="offset points", fontsize=8, color="0.3")
    ax.plot(steps, landed, "o-", color="C0", label="log2(amax × scale)")
    hot = [(s, v) for s, v, r in zip(steps, landed, records) if r.saturated > 0]
    if hot:
        ax.plot(*zip(*hot), "o", color="C3", label="some values saturated")
    ax.set_xlabel("step")
    ax.set_ylabel("log2 |value| after scaling")
    ax.set_title(f"{layer} · {role}: scale from the recipe, range of {fmt.name}")
    ax.legend(loc="lower right", fontsize=8)
    return ax


def plot_lowbit_grid(w: torch.Tensor, fmt: str, ax: Axes | None = None, bins: int = 120) -> Axes:
    """Histogram of the block-normalised weights (w / block absmax) with the format's code values."""
    f = get_lowbit(fmt)
    normed = block_normalized(w, f)
    ax = new_axes(ax, figsize=(7.0, 3.0))
    ax.hist(normed.cpu().numpy(), bins=bins, range=(-1, 1), color="C0", alpha=0.6)
    for v in f.codebook().tolist():
        ax.axvline(v, color="C3", lw=0.8)
    ax.set_xlabel("weight / block absmax")
    ax.set_ylabel("count")
    n = f.codebook().numel()
    ax.set_title(f"{f.name}: {n} code values (red) over the weights, "
                 f"{f.bits_per_param(w.shape):.3f} bits/param")
    return ax


def plot_side_by_side(result: Any, ax: Axes | None = None, smooth: int = 10) -> Axes:
    """Loss per step of each run of `ampnb.fp8.side_by_side`, smoothed by a running mean."""
    ax = new_axes(ax, figsize=(7.0, 3.0))
    for i, (run, losses) in enumerate(result.losses.items()):
        t = torch.tensor(losses, dtype=torch.float64)
        k = max(1, min(smooth, len(losses)))
        mean = torch.nn.functional.avg_pool1d(t[None, None], k, stride=1)[0, 0]
        ax.plot(range(k - 1, len(losses)), mean.tolist(), color=f"C{i}", label=run)
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss (running mean of {smooth})")
    ax.set_title("same model, same batches: 32-true vs bf16-mixed vs FP8")
    ax.legend(fontsize=8)
    return ax
