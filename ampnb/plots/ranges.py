"""Where values fall against float formats: the ladder, a tensor's histogram, layers, loss scale."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from matplotlib.axes import Axes
from torch import nn

from ampnb.block_formats import BLOCK_FORMATS
from ampnb.display import format_percent as _pct
from ampnb.formats import FloatFormat, get_format
from ampnb.instruments.coverage_stats import EXP_BINS, Coverage
from ampnb.instruments.summaries import TensorStats, summarize
from ampnb.plots._axes import new_axes
from ampnb.plots.blocks import plot_block_histogram

LADDER_FORMATS = ("fp32", "bf16", "fp16", "fp8_e5m2", "fp8_e4m3")
RANGE_FORMATS = ("fp16", "bf16", "fp8_e4m3")
NONE_COLOUR = "C3"  # rows no chosen format holds; format colours skip it
_COLOURS = ("C0", "C1", "C2", "C4", "C5", "C6", "C7", "C8", "C9")
_REACH = 24  # binades beyond the data within which a format's limit still widens the view

FormatLike = str | torch.dtype | FloatFormat


@dataclass(frozen=True)
class Band:
    """One format on a log2 axis: subnormals in [lo, normal), normals in [normal, hi]."""

    format: str
    lo: float      # log2 of the smallest subnormal
    normal: float  # log2 of the smallest normal
    hi: float      # log2 of the largest finite value


def band(fmt: FormatLike) -> Band:
    """The log2 limits of a format, straight from its derived properties."""
    f = get_format(fmt)
    return Band(f.name, math.log2(f.smallest_subnormal), math.log2(f.smallest_normal),
                math.log2(f.max))


def colour(i: int) -> str:
    """The colour of the i-th chosen format (never the 'no format holds it' colour)."""
    return _COLOURS[i % len(_COLOURS)]


def holds(fmt: FormatLike, amax: float, min_nonzero: float) -> bool:
    """Whether no value in [min_nonzero, amax] overflows or rounds to zero in fmt."""
    f = get_format(fmt)
    over = amax >= f.overflow_threshold if f.overflow_inclusive else amax > f.overflow_threshold
    return not over and not min_nonzero <= f.underflow_threshold


def _formats(formats: Iterable[FormatLike]) -> list[FloatFormat]:
    fmts = [get_format(f) for f in formats]
    if not fmts:
        raise ValueError("formats is empty; pass at least one, e.g. ('fp16', 'bf16')")
    return fmts


def _block_format(x: object, formats: Sequence[FormatLike]) -> str | None:
    """The one block format asked for, or None; a block view needs the tensor's values."""
    blocks = [f for f in formats if isinstance(f, str) and f in BLOCK_FORMATS]
    if not blocks:
        return None
    if len(formats) != 1:
        raise ValueError(f"block format {blocks[0]!r} is drawn on its own; pass formats="
                         f"({blocks[0]!r},) or only per-tensor formats")
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"block format {blocks[0]!r} needs the tensor itself (its blocks' "
                         f"scales), got {type(x).__name__}")
    return blocks[0]


def _pow2(v: float) -> str:
    e = math.log2(v)
    return f"2^{e:g}" if e == int(e) else f"2^{e:.2f}"


def plot_format_ladder(formats: Iterable[FormatLike] = LADDER_FORMATS,
                       ax: Axes | None = None) -> Axes:
    """Each format's subnormal and normal range as bands on a log2 axis, widest on top."""
    fmts = _formats(formats)
    ax = new_axes(ax, figsize=(8.0, 0.55 * len(fmts) + 1.2))
    for row, f in enumerate(reversed(fmts)):
        b, c = band(f), colour(len(fmts) - 1 - row)
        ax.barh(row, b.normal - b.lo, left=b.lo, height=0.6, color=c, alpha=0.35, hatch="///",
                edgecolor=c, gid=f"{f.name}:subnormal")
        ax.barh(row, b.hi - b.normal, left=b.normal, height=0.6, color=c, alpha=0.85,
                gid=f"{f.name}:normal")
        ax.text(b.hi + 2, row, f"max {f.max:.5g}, eps {_pow2(f.eps)}", va="center", fontsize=7)
        ax.text(b.lo - 2, row, _pow2(f.smallest_subnormal), va="center", ha="right", fontsize=7)
    ax.set_yticks(range(len(fmts)),
                  [f"{f.name} (e{f.exponent_bits}m{f.mantissa_bits})" for f in reversed(fmts)])
    ax.axvline(0, color="k", lw=0.6, ls=":")
    lo = min(band(f).lo for f in fmts)
    hi = max(band(f).hi for f in fmts)
    ax.set_xlim(lo - 0.12 * (hi - lo), hi + 0.3 * (hi - lo))
    ax.set_xlabel("log2 |x|   (hatched: subnormal, solid: normal; dotted line: |x| = 1)")
    ax.set_title("the format ladder: which magnitudes each format can hold", fontsize=10)
    return ax


def _stats(x: torch.Tensor | TensorStats, fmts: Sequence[FloatFormat]) -> TensorStats:
    if isinstance(x, TensorStats):
        return x
    if isinstance(x, torch.Tensor):
        return summarize(x, [f.name for f in fmts])
    raise ValueError(f"expected a torch.Tensor or a captured TensorStats, got {type(x).__name__}")


def _nonzero_range(hist: Sequence[int]) -> tuple[int, int] | None:
    """(first, last + 1) exponents of the non-empty histogram bins, or None."""
    ks = [EXP_BINS[i] for i, c in enumerate(hist) if c]
    return (ks[0], ks[-1] + 1) if ks else None


def _view(data: tuple[int, int], bands: Iterable[Band]) -> tuple[float, float]:
    """The data's binades, widened to nearby format limits (far ones would squash the data)."""
    lo, hi = data
    near = [v for b in bands for v in (b.lo, b.hi) if lo - _REACH <= v <= hi + _REACH]
    return min([lo, *near]) - 1, max([hi, *near]) + 1


def coverage_note(c: Coverage) -> str:
    """The overflow / underflow / subnormal percentages that the plots annotate."""
    return (f"{c.format}: overflow {_pct(c.overflow)} · underflow {_pct(c.underflow)} · "
            f"subnormal {_pct(c.subnormal)}")


def _lanes(ax: Axes, bands: Sequence[Band], notes: Sequence[str]) -> None:
    """Each format's bands in its own horizontal lane behind the data, with its note."""
    n = len(bands)
    for i, (b, note) in enumerate(zip(bands, notes)):
        y0, y1 = i / n, (i + 1) / n
        ax.axvspan(b.lo, b.normal, y0, y1, color=colour(i), alpha=0.15, hatch="//", lw=0,
                   zorder=0, gid=f"{b.format}:subnormal")
        ax.axvspan(b.normal, b.hi, y0, y1, color=colour(i), alpha=0.25, lw=0, zorder=0,
                   gid=f"{b.format}:normal")
        ax.text(0.005, (y0 + y1) / 2, note, transform=ax.transAxes, fontsize=7, va="center",
                gid=f"coverage:{b.format}", zorder=4,
                bbox={"facecolor": "white", "alpha": 0.7, "lw": 0, "pad": 1})


def plot_tensor_histogram(x: torch.Tensor | TensorStats,
                          formats: Iterable[FormatLike] = RANGE_FORMATS,
                          ax: Axes | None = None, title: str | None = None,
                          log: bool = True) -> Axes:
    """log2|x| histogram over the chosen formats' bands, with their coverage annotated; one
    block format (e.g. "mxfp4") draws the element range shifted by each block's scale."""
    formats = list(formats)
    block = _block_format(x, formats)
    if block is not None:
        return plot_block_histogram(x, block, ax=ax)  # type: ignore[arg-type]
    fmts = _formats(formats)
    s = _stats(x, fmts)
    ax = new_axes(ax, figsize=(8.0, 3.2))
    name = title or (f"{s.name} ({s.kind})" if s.name else "")
    data = _nonzero_range(s.histogram)
    if data is None:
        ax.text(0.5, 0.5, f"{name or 'tensor'}: no finite nonzero values to place",
                ha="center", va="center", transform=ax.transAxes)
        return ax
    covs = [s.coverage(f.name) for f in fmts]
    bands = [band(f) for f in fmts]
    _lanes(ax, bands, [coverage_note(c) for c in covs])
    ax.stairs(s.histogram, EXP_BINS, fill=True, color="0.2", alpha=0.8, zorder=3,
              gid="histogram", label="elements per binade")
    if log:
        ax.set_yscale("log")
        ax.set_ylim(0.5, max(s.histogram) * 3)
    ax.set_xlim(*_view(data, bands))
    c = covs[0]
    ax.set_xlabel("log2 |x|   (lanes: each format's normal range, hatched: subnormal)")
    ax.set_ylabel("elements")
    ax.set_title(f"{name + ': ' if name else ''}{c.count:,} elements, amax {c.amax:.3g}, "
                 f"min |x|>0 {c.min_nonzero:.3g}, zeros {_pct(c.zero)}, "
                 f"inf/NaN {_pct(c.nonfinite)}", fontsize=9)
    return ax


def _records(records: object, kind: str | None) -> list[TensorStats]:
    rows = list(getattr(records, "records", records))
    bad = [r for r in rows if not isinstance(r, TensorStats)]
    if bad:
        raise ValueError(f"plot_layer_summary needs captured TensorStats (or a Capture), "
                         f"got {type(bad[0]).__name__}")
    return [r for r in rows if kind is None or r.kind == kind]


def plot_layer_summary(records: object, formats: Iterable[FormatLike] = RANGE_FORMATS,
                       ax: Axes | None = None, kind: str | None = None) -> Axes:
    """A row per captured tensor, min |x|>0 to amax, coloured by the first format holding it all."""
    fmts = _formats(formats)
    rows = _records(records, kind)
    ax = new_axes(ax, figsize=(8.0, 0.28 * max(len(rows), 3) + 1.3))
    if not rows:
        ax.text(0.5, 0.5, f"no {kind or 'captured'} tensors", ha="center", va="center",
                transform=ax.transAxes)
        return ax
    for i, f in enumerate(fmts):
        b = band(f)
        ax.axvline(b.lo, color=colour(i), ls=":", lw=0.9, gid=f"{f.name}:lo")
        ax.axvline(b.hi, color=colour(i), ls="-", lw=0.9, gid=f"{f.name}:hi", label=f.name)
    ax.plot([], [], color=NONE_COLOUR, lw=5, label="none holds it")
    spans = []
    for y, r in enumerate(reversed(rows)):
        if not r.count or math.isnan(r.min_nonzero):
            ax.text(0, y, "  no finite nonzero values", va="center", fontsize=7)
            continue
        held = [f.name for f in fmts if holds(f, r.amax, r.min_nonzero)]
        c = colour([f.name for f in fmts].index(held[0])) if held else NONE_COLOUR
        lo, hi = math.log2(r.min_nonzero), math.log2(r.amax)
        spans.append((lo, hi))
        ax.plot([lo, hi], [y, y], color=c, lw=5, solid_capstyle="butt", gid=f"row:{r.kind}:{r.name}")
        ax.text(max(hi, lo + 0.5) + 0.5, y, ", ".join(held) or "none", va="center",
                fontsize=7, gid=f"holds:{r.kind}:{r.name}")
    ax.set_yticks(range(len(rows)), [f"{r.name} ({r.kind})" for r in reversed(rows)],
                  fontsize=7)
    ax.set_ylim(-0.7, len(rows) - 0.3)
    if spans:
        data = (math.floor(min(s[0] for s in spans)), math.ceil(max(s[1] for s in spans)) + 6)
        ax.set_xlim(*_view(data, [band(f) for f in fmts]))
    ax.set_xlabel("log2 |x|: each row spans min |x|>0 to amax, coloured by the first format "
                  "that holds it all\n(dotted: a format's smallest subnormal, solid: its max)")
    ax.set_title("captured tensors against the formats' ranges", fontsize=10)
    ax.legend(fontsize=7, loc="lower left", bbox_to_anchor=(0, 1.06), ncols=len(fmts) + 1,
              frameon=False)
    return ax


def _gradients(grads: object) -> list[torch.Tensor]:
    if isinstance(grads, nn.Module):
        ts = [p.grad for p in grads.parameters() if p.grad is not None]
    elif isinstance(grads, torch.Tensor):
        ts = [grads]
    else:
        ts = list(grads)
    bad = [t for t in ts if not isinstance(t, torch.Tensor) or not t.is_floating_point()]
    if bad:
        got = bad[0].dtype if isinstance(bad[0], torch.Tensor) else type(bad[0]).__name__
        raise ValueError(f"gradients must be floating-point tensors, got {got}")
    ts = [t for t in ts if t.numel()]
    if not ts:
        raise ValueError("no gradients to plot: run backward() first (or pass tensors)")
    return ts


def merge(covs: Sequence[Coverage]) -> Coverage:
    """Coverage of several tensors as one, by adding their counts."""
    def total(k: str) -> int:
        return sum(getattr(c, k) for c in covs)
    amaxes = [c.amax for c in covs if not math.isnan(c.amax)]
    mins = [c.min_nonzero for c in covs if not math.isnan(c.min_nonzero)]
    return Coverage(covs[0].format, total("count"), total("n_overflow"), total("n_underflow"),
                    total("n_subnormal"), total("n_normal"), total("n_zero"),
                    total("n_nonfinite"), max(amaxes, default=math.nan),
                    min(mins, default=math.nan))


def scale_effect(grads: object, scale: float, fmt: FormatLike = "fp16"
                 ) -> tuple[tuple[Coverage, list[int]], tuple[Coverage, list[int]]]:
    """(coverage, histogram) of the gradients before and after multiplying by scale."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (
            0 < scale < math.inf):
        raise ValueError(f"scale={scale!r} is not allowed; allowed: a positive finite number")
    f = get_format(fmt)
    out = []
    for factor in (1.0, float(scale)):
        # Widened to fp32 (fp64 stays): a power-of-two scale is then exact, as in GradScaler.
        stats = [summarize(t.detach().to(torch.promote_types(t.dtype, torch.float32)) * factor,
                           [f.name]) for t in _gradients(grads)]
        hist = [sum(col) for col in zip(*(s.histogram for s in stats))]
        out.append((merge([s.coverages[0] for s in stats]), hist))
    return out[0], out[1]


def plot_loss_scale_effect(grads: object, scale: float = 2.0**16, fmt: FormatLike = "fp16",
                           ax: Axes | None = None, log: bool = True) -> Axes:
    """Gradient log2 histograms before and after multiplying by a loss scale, against fmt."""
    f = get_format(fmt)
    (before, h0), (after, h1) = scale_effect(grads, scale, f)
    ax = new_axes(ax, figsize=(8.0, 3.2))
    b = band(f)
    ax.axvspan(b.lo, b.normal, color="C0", alpha=0.12, hatch="//", lw=0, zorder=0,
               gid=f"{f.name}:subnormal")
    ax.axvspan(b.normal, b.hi, color="C0", alpha=0.2, lw=0, zorder=0, gid=f"{f.name}:normal")
    label = _pow2(scale) if scale > 0 and math.log2(scale) == int(math.log2(scale)) else f"{scale:g}"
    ax.stairs(h0, EXP_BINS, fill=True, color="0.3", alpha=0.6, zorder=2, gid="before",
              label="gradients as computed")
    ax.stairs(h1, EXP_BINS, fill=True, color="C1", alpha=0.6, zorder=3, gid="after",
              label=f"× loss scale {label}")
    for y, gid, c, title in ((0.95, "coverage:before", before, "as computed"),
                             (0.85, "coverage:after", after, f"× {label}")):
        ax.text(0.99, y, f"{title}: " + coverage_note(c).removeprefix(f"{f.name}: "),
                transform=ax.transAxes, ha="right", va="top", fontsize=7, gid=gid, zorder=4,
                bbox={"facecolor": "white", "alpha": 0.7, "lw": 0, "pad": 1})
    ranges = [r for r in (_nonzero_range(h0), _nonzero_range(h1)) if r]
    if ranges:
        ax.set_xlim(*_view((min(r[0] for r in ranges), max(r[1] for r in ranges)), [b]))
    if log and ranges:
        ax.set_yscale("log")
        ax.set_ylim(0.5, max(h0 + h1) * 8)
    ax.set_xlabel(f"log2 |gradient|   (band: {f.name} normal range, hatched: subnormal)")
    ax.set_ylabel("elements")
    ax.set_title(f"a loss scale of {label} moves every gradient {math.log2(scale):.3g} binades "
                 f"right, against {f.name}'s range", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    return ax
