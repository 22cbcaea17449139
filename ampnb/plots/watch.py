"""A watched run drawn: loss scale and loss over steps, and each layer's headroom over steps."""

from __future__ import annotations

import math
from collections.abc import Iterable

from matplotlib.axes import Axes

from ampnb.formats import get_format
from ampnb.plots._axes import new_axes
from ampnb.watchlog.records import KINDS, StepRecord
from ampnb.watchlog.table import StepSummary, summarize


def _empty(ax: Axes, text: str) -> Axes:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)
    return ax


def plot_records(records: Iterable[StepRecord] | Iterable[StepSummary],
                 ax: Axes | None = None) -> Axes:
    """Loss scale per step (log2 axis) with skipped steps marked; the loss on a twin axis."""
    steps = summarize(records)
    ax = new_axes(ax, figsize=(7.0, 3.2))
    if not steps:
        return _empty(ax, "no steps recorded yet")
    xs = [s.step for s in steps]
    scaled = [s for s in steps if s.has_scaler]
    if scaled:
        ax.plot([s.step for s in scaled], [s.scale for s in scaled], color="C0",
                drawstyle="steps-post", label="loss scale")
        if min(s.scale for s in scaled) > 0:
            ax.set_yscale("log", base=2)
        skipped = [s for s in scaled if s.skipped]
        ax.scatter([s.step for s in skipped], [s.scale for s in skipped], marker="x",
                   color="C3", zorder=3, label=f"skipped ({len(skipped)})")
        ax.set_ylabel("loss scale")
    else:
        ax.set_yticks([])
        ax.set_ylabel("no GradScaler")
    # A non-finite step with no scaler to skip it: marked on the x axis, it has no scale.
    unguarded = [s.step for s in steps if s.nonfinite and not s.has_scaler]
    if unguarded:
        ax.scatter(unguarded, [0.0] * len(unguarded), marker="x", color="C3", zorder=3,
                   transform=ax.get_xaxis_transform(), clip_on=False,
                   label=f"non-finite, no scaler ({len(unguarded)})")
    ax.set_xlabel("optimizer step")
    twin = ax.twinx()
    finite = [(s.step, s.loss) for s in steps if math.isfinite(s.loss)]
    twin.plot([x for x, _ in finite], [v for _, v in finite], color="0.5", lw=1,
              marker="." if len(finite) < 60 else None, label="loss")
    twin.set_ylabel("loss", color="0.45")
    ax.set_xlim(min(xs) - 0.5, max(xs) + 0.5)
    handles, labels = ax.get_legend_handles_labels()
    h2, l2 = twin.get_legend_handles_labels()
    ax.legend(handles + h2, labels + l2, fontsize=7, loc="upper left", framealpha=0.8)
    ax.set_title("watched run: loss scale, skipped steps and loss", fontsize=10)
    return ax


def headroom_series(records: Iterable[StepRecord], kind: str = "act",
                    fmt: str = "fp16") -> tuple[list[int], dict[str, list[float]]]:
    """(stats steps, per layer the headroom at each; nan where not measured or amax 0)."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not allowed; allowed: {', '.join(KINDS)}")
    get_format(fmt)  # any format ampnb knows; its error names the allowed ones
    recs = [r for r in records if r.layers]
    low: dict[int, StepRecord] = {}
    for r in recs:  # one rank per step: the lowest, as layers_table shows
        if r.step not in low or r.rank < low[r.step].rank:
            low[r.step] = r
    steps = sorted(low)
    series: dict[str, list[float]] = {}
    for i, step in enumerate(steps):
        for la in low[step].layers:
            h = la.headroom(kind, fmt)
            series.setdefault(la.module, [math.nan] * len(steps))[i] = h if math.isfinite(h) \
                else math.nan
    return steps, series


def plot_headroom(records: Iterable[StepRecord], kind: str = "act", fmt: str = "fp16",
                  ax: Axes | None = None, worst: int = 8) -> Axes:
    """Headroom (binades to fmt's max) per layer over the stats steps: the `worst` layers."""
    if isinstance(worst, bool) or not isinstance(worst, int) or worst < 1:
        raise ValueError(f"worst={worst!r} is not allowed; allowed: an integer >= 1")
    records = list(records)
    steps, series = headroom_series(records, kind, fmt)
    ax = new_axes(ax, figsize=(7.0, 3.2))
    name = get_format(fmt).name
    if not steps:
        return _empty(ax, "no layer statistics yet (recorded every `every` steps)")

    def least(vals: list[float]) -> float:
        finite = [v for v in vals if not math.isnan(v)]
        return min(finite) if finite else math.inf
    order = sorted(series, key=lambda m: (least(series[m]), m))[:worst]
    for k, module in enumerate(order):
        ax.plot(steps, series[module], marker="." if len(steps) < 60 else None,
                color=f"C{k % 10}", label=module)
    ax.axhline(0.0, color="C3", lw=1.0, ls="--", label=f"{name} max (below: overflow)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"headroom to {name} (binades)")
    shown = f"the {len(order)} of {len(series)} layers with least headroom" \
        if len(order) < len(series) else f"{len(series)} layers"
    ax.set_title(f"{kind} amax headroom to {name}: {shown}", fontsize=10)
    ax.legend(fontsize=7, loc="best", framealpha=0.8)
    return ax
