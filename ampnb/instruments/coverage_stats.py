"""Format coverage (overflow / underflow / subnormal fractions) and log2 exponent histograms."""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ampnb.display import Table, TableView, format_percent
from ampnb.formats import FloatFormat, get_format

# EXP_* and _cut_points are imported from here by plots, benchmarks and tests.
from ampnb.instruments._bins import (  # noqa: F401
    _EDGES,
    _INF_BITS,
    _SHARED,
    EXP_BINS,
    EXP_MAX,
    EXP_MIN,
    FormatLike,
    _cut_points,
)
from ampnb.instruments._bitkeys import _plan, count_segments


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


@dataclass(frozen=True, eq=False)
class SegmentCounts:
    """Counts of every segment of a flat tensor against some formats, from one table made in a
    few torch calls for all segments. A segment's Coverage objects and histogram are built
    when first read: capture keeps one per record, and most are never looked at one by one."""

    formats: tuple[tuple[str, int, int, int], ...]  # per format: name, cols of its three cuts
    shared: tuple[int, int, int]  # cols of how many |x| >= 0, float32's tiniest value, inf
    head: int                     # the histogram's bins start at this col
    lengths: tuple[int, ...]
    amax: list[float]             # per segment
    min_nonzero: list[float]
    table: torch.Tensor | list    # a row per segment (a tensor until first read)

    @functools.cached_property
    def _rows(self) -> list[list[int]]:
        t = self.table
        return t.tolist() if isinstance(t, torch.Tensor) else t  # one transfer for all rows

    def coverages(self, i: int) -> dict[str, Coverage]:
        """Segment i's Coverage in every format, by format name."""
        row, n = self._rows[i], self.lengths[i]
        g0, gtiny, ginf = (row[j] for j in self.shared)
        amax, min_nz = self.amax[i], self.min_nonzero[i]
        return {name: _from_counts(name, n, row[pu], row[pn], row[po], g0, gtiny, ginf, amax,
                                   min_nz) for name, pu, pn, po in self.formats}

    def histogram(self, i: int) -> tuple[int, ...]:
        """Segment i's counts over EXP_BINS."""
        return tuple(self._rows[i][self.head:])


def segment_stats(flat: torch.Tensor, lengths: Sequence[int], formats: Iterable[FormatLike],
                  absolute: bool = False) -> list[tuple[dict[str, Coverage], list[int]]]:
    """Coverage in every format and the exponent histogram of each segment of a flat tensor."""
    return _expand(segment_counts(flat.split(list(lengths)), formats, absolute))


def _expand(c: SegmentCounts) -> list[tuple[dict[str, Coverage], list[int]]]:
    return [(c.coverages(i), list(c.histogram(i))) for i in range(len(c.lengths))]


def segment_counts(parts: Sequence[torch.Tensor], formats: Iterable[FormatLike],
                   absolute: bool = False) -> SegmentCounts:
    """Counts of each of some flat tensors of one dtype, for its coverage and exponent histogram.

    Every count is "how many |x| >= b". For float32 they come from the bit pattern: a 16-bit
    key per element, one bincount, on the tensors' own device (see _bitkeys); only small
    count tables come back to the host. float64 takes a bucketize. absolute: the parts hold
    |x| already (sign bits clear, as capture stages them), which saves a pass.
    """
    fmts = tuple(get_format(f) for f in formats)
    lengths = [p.numel() for p in parts]
    if parts[0].dtype != torch.float32 or not all(lengths):
        return _bucketize_counts(torch.cat(parts) if len(parts) > 1 else parts[0], lengths, fmts)
    plan = _plan(fmts)
    table, shared, ext = count_segments(parts, plan, absolute)
    # The extremes' bits as floats in one conversion (a float32 value is exact as a double);
    # no finite (nonzero) element: nan. (Bits past inf's, or -1, mean "none": unused.)
    m = len(ext)
    bits = struct.unpack(f"<{m}f", struct.pack(f"<{m}i", *[min(max(e, -1), _INF_BITS) for e in ext]))
    g0, gtiny, ginf = shared
    amax = [bits[2 * i] if a > c else math.nan for i, (a, c) in enumerate(zip(g0, ginf))]
    min_nz = [bits[2 * i + 1] if b > c else math.nan
              for i, (b, c) in enumerate(zip(gtiny, ginf))]
    return SegmentCounts(*_columns(fmts), plan.head, tuple(lengths), amax, min_nz, table)


@functools.lru_cache(maxsize=64)
def _columns(fmts: tuple[FloatFormat, ...]) -> tuple[tuple, tuple[int, int, int]]:
    """SegmentCounts' formats and shared columns for the bit-key plan of these formats."""
    plan = _plan(fmts)
    at = {v: i for i, v in enumerate(plan.values[:plan.head])}
    return (tuple((f.name, at[pu], at[pn], at[po]) for f, (pu, pn, po) in zip(fmts, plan.cuts)),
            tuple(at[v] for v in _SHARED))


def _from_counts(name: str, n: int, gu: int, gn: int, go: int, g0: int, gtiny: int,
                 ginf: int, amax: float, min_nz: float) -> Coverage:
    """One format's Coverage from counts of |x| >= b: at its cuts (past underflow gu, normal gn,
    overflow go) and at 0, float32's tiniest value and inf. Positional: this runs for every
    format of every captured tensor."""
    return _coverage(name, n, go - ginf, gtiny - gu, gu - gn, gn - go, g0 - gtiny,
                     n - g0 + ginf, amax, min_nz)


def _bucketize_counts(flat: torch.Tensor, lengths: Sequence[int], fmts: Sequence[FloatFormat]
                      ) -> SegmentCounts:
    """The general path: one bucketize against every boundary, then one bincount."""
    work = get_format(flat.dtype)
    shared = (0.0, work.smallest_subnormal, math.inf)
    cuts = [_cut_points(f, work) for f in fmts]
    bnd = sorted({*shared, *(c for cs in cuts for c in cs), *_EDGES})
    a = flat.abs()
    codes = torch.bucketize(a, torch.tensor(bnd, dtype=a.dtype, device=a.device), right=True,
                            out_int32=True)  # how many boundaries are <= |x|
    codes.masked_fill_(torch.isnan(a), 0)  # NaN is >= nothing
    width, nseg = len(bnd) + 1, len(lengths)
    finite = a <= work.max
    seg = torch.repeat_interleave(torch.arange(nseg, device=a.device),
                                  torch.tensor(lengths, device=a.device))
    table = torch.bincount(seg * width + codes, minlength=nseg * width).view(nseg, width)
    ext = torch.stack([
        a.new_zeros(nseg).scatter_reduce(0, seg, torch.where(finite, a, 0), "amax"),
        a.new_full((nseg,), math.inf).scatter_reduce(
            0, seg, torch.where(finite & (a > 0), a, math.inf), "amin")], dim=1)
    # ge[:, j] = how many |x| >= bnd[j]; one transfer for counts and extremes together.
    ge = table.flip(1).cumsum(1).flip(1)[:, 1:]
    rows = torch.cat([ge.double(), ext.double()], dim=1).tolist()
    col = {b: j for j, b in enumerate(bnd)}
    head = len(bnd)
    out, amax, min_nz = [], [], []
    for row in rows:
        g = [int(v) for v in row[:head]]
        g0, gtiny, ginf = (g[col[b]] for b in shared)
        levels = [gtiny, *(g[col[e]] for e in _EDGES), ginf]
        out.append(g + [levels[j] - levels[j + 1] for j in range(len(levels) - 1)])
        amax.append(row[-2] if g0 > ginf else math.nan)
        min_nz.append(row[-1] if gtiny > ginf else math.nan)
    return SegmentCounts(tuple((f.name, col[pu], col[pn], col[po])
                               for f, (pu, pn, po) in zip(fmts, cuts)),
                         tuple(col[b] for b in shared), head, tuple(lengths), amax, min_nz, out)


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
