"""Format coverage (overflow / underflow / subnormal fractions) and log2 exponent histograms."""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ampnb.display import Table, TableView, format_percent
from ampnb.formats import FloatFormat, get_format

# EXP_* and cut_points are imported from here by plots, benchmarks and tests.
from ampnb.instruments._bins import (  # noqa: F401
    EXP_BINS,
    EXP_MAX,
    EXP_MIN,
    HISTOGRAM_EDGES,
    INF_BITS,
    SHARED_LEVELS,
    FormatLike,
    Levels,
    cut_points,
)
from ampnb.instruments._bitkeys import count_segments
from ampnb.instruments._keyplan import key_plan


@dataclass(frozen=True, repr=False)
class Coverage(TableView):
    """How the elements of one tensor land in one format once rounded to nearest even."""

    format: str
    count: int
    n_overflow: int
    n_underflow: int
    n_subnormal: int
    n_normal: int
    n_zero: int
    n_nonfinite: int
    amax: float         # largest finite magnitude (nan if there is none)
    min_nonzero: float  # smallest nonzero finite magnitude (nan if there is none)

    def _frac(self, n: int) -> float:
        return n / self.count if self.count else 0.0

    overflow = property(lambda self: self._frac(self.n_overflow))
    underflow = property(lambda self: self._frac(self.n_underflow))
    subnormal = property(lambda self: self._frac(self.n_subnormal))
    normal = property(lambda self: self._frac(self.n_normal))
    zero = property(lambda self: self._frac(self.n_zero))
    nonfinite = property(lambda self: self._frac(self.n_nonfinite))

    def fractions(self) -> dict[str, float]:
        """The six fractions by name; they sum to 1."""
        return {k: getattr(self, k) for k in CATEGORIES}

    def table(self) -> Table:
        """This record as a one-row coverage table."""
        return coverage_table([self])


def _coverage(name: str, n: int, over: int, under: int, sub: int, normal: int, zero: int,
              nonfinite: int, amax: float, min_nz: float) -> Coverage:
    """Coverage(...) with its fields set in one step rather than one by one, as a frozen
    dataclass's __init__ does (a third of the cost): this runs for every format of every
    captured tensor."""
    c = object.__new__(Coverage)
    object.__setattr__(c, "__dict__", {
        "format": name, "count": n, "n_overflow": over, "n_underflow": under,
        "n_subnormal": sub, "n_normal": normal, "n_zero": zero, "n_nonfinite": nonfinite,
        "amax": amax, "min_nonzero": min_nz})
    return c


CATEGORIES = ("overflow", "underflow", "subnormal", "normal", "zero", "nonfinite")


def _as_float_tensor(x: object, what: str = "coverage") -> torch.Tensor:
    """x flattened, in float32 (or float64): both hold every narrower format's values exactly."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{what} needs a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{what} needs a floating-point tensor, got dtype {x.dtype}")
    if x.numel() == 0:
        raise ValueError(f"{what} needs a non-empty tensor, got shape {tuple(x.shape)}")
    if x.is_meta:
        raise ValueError(f"{what} needs values to count, got a meta tensor (shape only); "
                         f"allowed: a tensor with data, on cpu or cuda")
    x = x.detach().reshape(-1)
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


class FormatColumns(NamedTuple):
    """Where one format's counts lie in a SegmentCounts row: columns of its three cut points."""

    name: str
    past_underflow: int
    normal: int
    overflow: int


@dataclass(frozen=True, eq=False)
class SegmentCounts:
    """Counts of every segment of a flat tensor against some formats, from one table made in a
    few torch calls for all segments. A segment's Coverage objects and histogram are built
    when first read: capture keeps one per record, and most are never looked at one by one."""

    formats: tuple[FormatColumns, ...]
    shared: Levels                # columns of how many |x| >= each shared level
    first_bin: int                # the histogram's bins start at this column
    lengths: tuple[int, ...]
    amax: list[float]             # per segment
    min_nonzero: list[float]
    table: torch.Tensor | list    # a row per segment (a tensor until first read)

    @functools.cached_property
    def _rows(self) -> list[list[int]]:
        table = self.table
        return table.tolist() if isinstance(table, torch.Tensor) else table  # one transfer

    def coverages(self, i: int) -> dict[str, Coverage]:
        """Segment i's Coverage in every format, by format name."""
        row, n = self._rows[i], self.lengths[i]
        ge_zero, ge_tiniest, ge_inf = (row[j] for j in self.shared)
        amax, min_nz = self.amax[i], self.min_nonzero[i]
        return {name: _from_counts(name, n, row[under], row[normal], row[over], ge_zero,
                                   ge_tiniest, ge_inf, amax, min_nz)
                for name, under, normal, over in self.formats}

    def histogram(self, i: int) -> tuple[int, ...]:
        """Segment i's counts over EXP_BINS."""
        return tuple(self._rows[i][self.first_bin:])


def segment_stats(flat: torch.Tensor, lengths: Sequence[int], formats: Iterable[FormatLike],
                  absolute: bool = False) -> list[tuple[dict[str, Coverage], list[int]]]:
    """Coverage in every format and the exponent histogram of each segment of a flat tensor."""
    return per_segment(segment_counts(flat.split(list(lengths)), formats, absolute))


def per_segment(c: SegmentCounts) -> list[tuple[dict[str, Coverage], list[int]]]:
    """(Coverage by format, histogram) of every segment of c."""
    return [(c.coverages(i), list(c.histogram(i))) for i in range(len(c.lengths))]


def segment_counts(parts: Sequence[torch.Tensor], formats: Iterable[FormatLike],
                   absolute: bool = False) -> SegmentCounts:
    """Counts of each of some flat tensors of one dtype, for its coverage and exponent histogram.

    Every count is "how many |x| >= b". For float32 they come from the bit pattern: a 16-bit
    key per element, one bincount, on the tensors' own device (see _bitkeys); only small
    count tables come back to the host. float64 (and empty parts) take bucketize_counts.
    absolute: the parts hold |x| already (sign bits clear, as capture stages them), which
    saves a pass.
    """
    fmts = tuple(get_format(f) for f in formats)
    lengths = [p.numel() for p in parts]
    if parts[0].dtype != torch.float32 or not all(lengths):
        return bucketize_counts(torch.cat(parts) if len(parts) > 1 else parts[0], lengths, fmts)
    counts = count_segments(parts, key_plan(fmts), absolute)
    n = len(lengths)
    extremes = _floats_of_bits(counts.amax_bits + counts.min_nonzero_bits)
    # nan where a segment has no finite (nonzero) element: its bits then mean nothing
    shared = counts.shared
    amax = [v if ge_zero > ge_inf else math.nan
            for v, ge_zero, ge_inf in zip(extremes[:n], shared.zero, shared.inf)]
    min_nz = [v if ge_tiniest > ge_inf else math.nan
              for v, ge_tiniest, ge_inf in zip(extremes[n:], shared.tiniest, shared.inf)]
    return SegmentCounts(*_columns(fmts), tuple(lengths), amax, min_nz, counts.table)


def _floats_of_bits(bits: list[int]) -> tuple[float, ...]:
    """float32 bit patterns as floats in one conversion (exact as doubles); values out of
    range (past inf's bits, or -1: "none") are clamped and then ignored by the caller."""
    n = len(bits)
    return struct.unpack(f"<{n}f", struct.pack(f"<{n}i", *[min(max(b, -1), INF_BITS)
                                                            for b in bits]))


@functools.lru_cache(maxsize=64)
def _columns(fmts: tuple[FloatFormat, ...]) -> tuple[tuple[FormatColumns, ...], Levels, int]:
    """SegmentCounts' format columns, shared columns and first bin for these formats."""
    plan = key_plan(fmts)
    at = {v: i for i, v in enumerate(plan.levels[:plan.head_levels])}
    return (tuple(FormatColumns(f.name, *(at[c] for c in cuts))
                  for f, cuts in zip(fmts, plan.cuts)),
            Levels(*(at[v] for v in SHARED_LEVELS)), plan.head_levels)


def _from_counts(name: str, n: int, ge_past_underflow: int, ge_normal: int, ge_overflow: int,
                 ge_zero: int, ge_tiniest: int, ge_inf: int, amax: float, min_nz: float
                 ) -> Coverage:
    """One format's Coverage from counts of |x| >= each level (ge_*): its cut points, and the
    shared levels 0, float32's tiniest value and inf. Positional: this runs for every format
    of every captured tensor."""
    return _coverage(name, n, ge_overflow - ge_inf, ge_tiniest - ge_past_underflow,
                     ge_past_underflow - ge_normal, ge_normal - ge_overflow, ge_zero - ge_tiniest,
                     n - ge_zero + ge_inf, amax, min_nz)


def bucketize_counts(flat: torch.Tensor, lengths: Sequence[int], fmts: Sequence[FloatFormat]
                     ) -> SegmentCounts:
    """The simple path, and the oracle the bit-key path is tested against: one bucketize of
    |x| against every level, then one bincount per segment (any dtype; float64 uses it)."""
    work = get_format(flat.dtype)
    shared = Levels(0.0, work.smallest_subnormal, math.inf)
    cuts = [cut_points(f, work) for f in fmts]
    levels = sorted({*shared, *(c for cs in cuts for c in cs), *HISTOGRAM_EDGES})
    mag = flat.abs()  # |x|
    codes = torch.bucketize(mag, torch.tensor(levels, dtype=mag.dtype, device=mag.device),
                            right=True, out_int32=True)  # how many levels are <= |x|
    codes.masked_fill_(torch.isnan(mag), 0)  # NaN is >= nothing
    width, n_seg = len(levels) + 1, len(lengths)
    finite = mag <= work.max
    seg = torch.repeat_interleave(torch.arange(n_seg, device=mag.device),
                                  torch.tensor(lengths, device=mag.device))
    table = torch.bincount(seg * width + codes, minlength=n_seg * width).view(n_seg, width)
    extremes = torch.stack([
        mag.new_zeros(n_seg).scatter_reduce(0, seg, torch.where(finite, mag, 0), "amax"),
        mag.new_full((n_seg,), math.inf).scatter_reduce(
            0, seg, torch.where(finite & (mag > 0), mag, math.inf), "amin")], dim=1)
    # ge[:, j] = how many |x| >= levels[j]; one transfer for counts and extremes together.
    ge = table.flip(1).cumsum(1).flip(1)[:, 1:]
    rows = torch.cat([ge.double(), extremes.double()], dim=1).tolist()
    col = {v: j for j, v in enumerate(levels)}
    first_bin = len(levels)
    out, amax, min_nz = [], [], []
    for row in rows:
        counts, (row_amax, row_min_nz) = [int(v) for v in row[:first_bin]], row[first_bin:]
        ge_zero, ge_tiniest, ge_inf = (counts[col[v]] for v in shared)
        # mag bin's count = how many >= its lower edge - how many >= its upper edge
        edges = [ge_tiniest, *(counts[col[e]] for e in HISTOGRAM_EDGES), ge_inf]
        out.append(counts + [edges[j] - edges[j + 1] for j in range(len(edges) - 1)])
        amax.append(row_amax if ge_zero > ge_inf else math.nan)
        min_nz.append(row_min_nz if ge_tiniest > ge_inf else math.nan)
    return SegmentCounts(tuple(FormatColumns(f.name, *(col[c] for c in cs))
                               for f, cs in zip(fmts, cuts)),
                         Levels(*(col[v] for v in shared)), first_bin, tuple(lengths), amax,
                         min_nz, out)


def coverage_many(x: torch.Tensor, formats: Iterable[FormatLike]) -> dict[str, Coverage]:
    """Coverage of x in several formats, sharing one pass over the tensor."""
    fmts = [get_format(f) for f in formats]
    flat = _as_float_tensor(x)
    return segment_stats(flat, [flat.numel()], fmts)[0][0]


def coverage(x: torch.Tensor, fmt: FormatLike) -> Coverage:
    """Fractions of x's elements that overflow, underflow, go subnormal or stay normal in fmt."""
    f = get_format(fmt)
    return coverage_many(x, [f])[f.name]


def exponent_histogram(x: torch.Tensor) -> torch.Tensor:
    """Counts of floor(log2|x|) over EXP_BINS for finite nonzero x (a small CPU int64 tensor)."""
    flat = _as_float_tensor(x, "exponent_histogram")
    return torch.tensor(segment_stats(flat, [flat.numel()], [])[0][1])


def coverage_table(rows: Iterable[Coverage], labels: Iterable[str] | None = None,
                   caption: str = "") -> Table:
    """Coverage records side by side as a deterministic table."""
    rows = list(rows)
    names = list(labels) if labels is not None else [c.format for c in rows]
    cells = [(name, *(format_percent(getattr(c, k)) for k in CATEGORIES), f"{c.amax:.4g}",
              f"{c.min_nonzero:.4g}", c.count) for name, c in zip(names, rows)]
    return Table(("tensor" if labels is not None else "format", *CATEGORIES, "amax",
                  "min |x|>0", "elements"), cells, caption=caption)
