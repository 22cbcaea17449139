"""The training loss over steps, coloured by the precision mode each stretch of steps ran in."""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import groupby
from typing import Any

from matplotlib.axes import Axes
from matplotlib.ticker import MaxNLocator

from ampnb.modes import MODES
from ampnb.plots._axes import new_axes

# One colour per mode, in MODES order, so a mode looks the same in every figure.
MODE_COLORS = {name: f"C{i}" for i, name in enumerate(MODES)}


def _records(source: Any) -> Sequence[Any]:
    """Step records from a Workbench (its .history) or a list of StepRecords."""
    return source.history if hasattr(source, "history") else list(source)


def segments(records: Sequence[Any]) -> list[tuple[tuple[str, str, bool], list[Any]]]:
    """Runs of consecutive records with the same (mode, device, tf32)."""
    return [(key, list(group)) for key, group in
            groupby(records, key=lambda r: (r.mode, r.device, r.tf32))]


def plot_loss_curve(source: Any, ax: Axes | None = None) -> Axes:
    """Loss per step, one coloured stretch per mode/device/TF32 segment, skips and inf/NaN marked."""
    records = _records(source)
    ax = new_axes(ax, figsize=(7.0, 3.0))
    if not records:
        ax.text(0.5, 0.5, "no steps yet: press Step", ha="center", va="center",
                transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
        return ax
    finite = [r for r in records if math.isfinite(r.loss)]
    # A thin grey line through every finite point keeps the curve continuous across switches.
    ax.plot([r.step for r in finite], [r.loss for r in finite], color="0.8", lw=1, zorder=1)
    labelled: set[str] = set()
    for k, ((mode, _device, tf32), group) in enumerate(segments(records)):
        if k:
            ax.axvline(group[0].step - 0.5, color="0.6", ls=":", lw=0.8)
        pts = [r for r in group if math.isfinite(r.loss)]
        label = None if mode in labelled else mode
        labelled.add(mode)
        ax.plot([r.step for r in pts], [r.loss for r in pts], color=MODE_COLORS.get(mode, "0.3"),
                marker="o", ms=3, lw=1.8, ls="--" if tf32 else "-", label=label, zorder=2)
    skipped = [r for r in finite if r.skipped]
    if skipped:
        ax.scatter([r.step for r in skipped], [r.loss for r in skipped], marker="x", color="C3",
                   s=40, zorder=3, label=f"skipped by GradScaler ({len(skipped)})")
    bad = [r for r in records if not math.isfinite(r.loss)]
    for i, r in enumerate(bad):
        ax.axvline(r.step, color="C3", lw=1.5, alpha=0.6,
                   label=f"loss inf/NaN ({len(bad)})" if i == 0 else None)
    positive = [r.loss for r in finite if r.loss > 0]
    if positive and len(positive) == len(finite) and max(positive) / min(positive) > 50:
        ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("training loss by precision mode (dashed: TF32 on; dotted lines: switches)",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    return ax
