"""The loss scale over steps (growth and backoff), and gradients before/after scaling vs fp16."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from matplotlib.axes import Axes
from matplotlib.ticker import MaxNLocator

from ampnb.formats import get_format
from ampnb.plots._axes import new_axes


def _history(source: Any) -> tuple[Sequence[Any], Any]:
    """(step records, settings or None) from a ScalerStepper or a list of StepRecords."""
    if hasattr(source, "history"):
        return source.history, getattr(source, "settings", None)
    return list(source), None


def plot_scale_history(source: Any, ax: Axes | None = None,
                       growth_interval: int | None = None) -> Axes:
    """Scale per step (log2 axis) with skipped steps and growths marked, growth tracker beside."""
    history, settings = _history(source)
    interval = growth_interval or (settings.growth_interval if settings else None)
    ax = new_axes(ax, figsize=(7.0, 3.2))
    if not history:
        ax.text(0.5, 0.5, "no steps yet", ha="center", va="center", transform=ax.transAxes)
        return ax
    steps = [r.step for r in history]
    # The scale a step used, then the scale update() left: a staircase over steps.
    xs = [*steps, steps[-1] + 1]
    ys = [r.scale for r in history] + [history[-1].new_scale]
    ax.step(xs, ys, where="post", color="C0", label="scale")
    if min(ys) > 0:
        ax.set_yscale("log", base=2)
    skipped = [r for r in history if r.skipped]
    ax.scatter([r.step for r in skipped], [r.scale for r in skipped], marker="x", color="C3",
               zorder=3, label=f"skipped ({len(skipped)})")
    grew = [r for r in history if r.new_scale > r.scale]
    ax.scatter([r.step + 1 for r in grew], [r.new_scale for r in grew], marker="^", color="C2",
               zorder=3, label=f"growth ({len(grew)})")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss scale")
    tracker = ax.twinx()
    tracker.plot([s + 1 for s in steps], [r.growth_tracker for r in history], color="0.6",
                 lw=1, ls="-", marker=".", label="growth tracker")
    if interval:
        tracker.axhline(interval, color="0.6", ls="--", lw=0.8)
        tracker.set_ylim(0, interval * 1.1)
    tracker.yaxis.set_major_locator(MaxNLocator(integer=True))
    tracker.set_ylabel("growth tracker", color="0.45")
    title = "loss scale"
    if settings:
        title += (f": x{settings.growth_factor:g} after {settings.growth_interval} clean steps, "
                  f"x{settings.backoff_factor:g} on inf/NaN")
    ax.set_title(title, fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    h2, l2 = tracker.get_legend_handles_labels()
    ax.legend(handles + h2, labels + l2, fontsize=7, loc="upper left", framealpha=0.8)
    return ax


def _log2_abs(values: torch.Tensor) -> torch.Tensor:
    v = values.detach().float().abs()
    v = v[torch.isfinite(v) & (v > 0)]
    return torch.log2(v).cpu()


def plot_grad_scaling(source: Any, ax: Axes | None = None, fmt: str = "fp16",
                      bins: int = 60) -> Axes:
    """Histogram of log2|grad| before and after unscaling, against a format's range."""
    grads = source.last_grads if hasattr(source, "last_grads") else source
    f = get_format(fmt)
    ax = new_axes(ax, figsize=(7.0, 3.0))
    if not grads or grads.get("scaled") is None:
        ax.text(0.5, 0.5, "no gradients yet: run a step", ha="center", va="center",
                transform=ax.transAxes)
        return ax
    scaled, unscaled = _log2_abs(grads["scaled"]), _log2_abs(grads["unscaled"])
    both = torch.cat([scaled, unscaled])
    lo = min(both.min().item(), math.log2(f.smallest_subnormal)) - 1
    hi = max(both.max().item(), math.log2(f.max)) + 1
    edges = torch.linspace(lo, hi, bins + 1).tolist()
    ax.hist(unscaled.numpy(), bins=edges, alpha=0.6, color="C0", label="unscaled (true) gradients")
    ax.hist(scaled.numpy(), bins=edges, alpha=0.6, color="C1", label="scaled gradients")
    for value, name, style in ((f.smallest_subnormal, "smallest subnormal", ":"),
                               (f.smallest_normal, "smallest normal", "--"),
                               (f.max, "max", "-")):
        ax.axvline(math.log2(value), color="k", ls=style, lw=0.8)
        ax.text(math.log2(value), 1.0, f" {f.name} {name}", rotation=90, va="top", fontsize=7,
                transform=ax.get_xaxis_transform())
    ax.set_xlabel("log2 |gradient|")
    ax.set_ylabel("count")
    ax.set_title(f"gradients before and after scaling, against {f.name}'s range", fontsize=10)
    ax.legend(fontsize=8, loc="upper center")
    return ax


def plot_step_gradients(stepper: Any, ax: Axes | None = None, fmt: str = "fp16") -> Axes:
    """The last step's true gradients and the same times its loss scale, against fmt's range."""
    from ampnb.plots.ranges import plot_loss_scale_effect  # the instruments' histogram

    grads = getattr(stepper, "last_grads", None) or {}
    if grads.get("unscaled") is None:
        ax = new_axes(ax, figsize=(7.0, 3.2))
        ax.text(0.5, 0.5, "no gradients yet: run a step", ha="center", va="center",
                transform=ax.transAxes)
        return ax
    unscaled = grads["unscaled"]
    ax = plot_loss_scale_effect(unscaled, scale=grads["scale"], fmt=fmt, ax=ax)
    bad = int((~torch.isfinite(unscaled)).sum())
    if bad:  # inf/NaN have no place on a log2 axis: say how many were left out, and why
        ax.text(0.5, 0.5, f"{bad} of {unscaled.numel()} gradients inf/NaN (found_inf): "
                "not drawn; this step is skipped", ha="center", va="center", fontsize=8,
                color="C3", transform=ax.transAxes, bbox={"facecolor": "white", "alpha": 0.8})
    return ax
