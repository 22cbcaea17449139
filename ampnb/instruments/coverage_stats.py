"""Format coverage (overflow / underflow / subnormal fractions) and log2 exponent histograms."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ampnb._html import Table
from ampnb.formats import FloatFormat, get_format

# One binning for every exponent histogram: bin i holds |x| in [2**(EXP_MIN+i), 2**(EXP_MIN+i+1)).
# It spans fp32's subnormals (2**-149) to its overflow (2**128); fp64 values beyond land in
# the end bins.
EXP_MIN, EXP_MAX = -150, 128
EXP_BINS: tuple[int, ...] = tuple(range(EXP_MIN, EXP_MAX + 1))

FormatLike = str | torch.dtype | FloatFormat


@dataclass(frozen=True)
class Coverage:
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

    def _repr_html_(self) -> str:
        return coverage_table([self])._repr_html_()

    def __repr__(self) -> str:
        return repr(coverage_table([self]))


CATEGORIES = ("overflow", "underflow", "subnormal", "normal", "zero", "nonfinite")


def _as_float_tensor(x: object, what: str = "coverage") -> torch.Tensor:
    """x flattened, in float32 (or float64): both hold every narrower format's values exactly."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{what} needs a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{what} needs a floating-point tensor, got dtype {x.dtype}")
    if x.numel() == 0:
        raise ValueError(f"{what} needs a non-empty tensor, got shape {tuple(x.shape)}")
    x = x.detach().reshape(-1)
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _snap(t: float, fmt: FloatFormat, up: bool) -> float:
    """Round t up (or down) to a value of `fmt`, so a comparison in that dtype is exact."""
    if not math.isfinite(t) or t == 0.0:
        return t
    _, e = math.frexp(t)
    ulp = math.ldexp(1.0, max(e - 1, fmt.min_exponent) - fmt.mantissa_bits)
    v = (math.ceil if up else math.floor)(t / ulp) * ulp
    return math.inf if v > fmt.max else v


def _next_up(v: float, fmt: FloatFormat) -> float:
    """The next value of `fmt` above v >= 0 (inf past its max)."""
    if fmt.mantissa_bits >= 52:
        return math.nextafter(v, math.inf)
    e = math.frexp(v)[1] if v > 0 else fmt.min_exponent
    nxt = v + math.ldexp(1.0, max(e - 1, fmt.min_exponent) - fmt.mantissa_bits)
    return math.inf if nxt > fmt.max else nxt


def _cut_points(f: FloatFormat, work: FloatFormat) -> tuple[float, float, float]:
    """Smallest values (of the work dtype) past underflow, at normal, and at overflow."""
    past_underflow = _next_up(_snap(f.underflow_threshold, work, up=False), work)
    normal = _snap(f.normal_threshold, work, up=True)
    ot = f.overflow_threshold
    if f.overflow_inclusive:
        over = _snap(ot, work, up=True)
    else:
        over = _next_up(_snap(ot, work, up=False), work)
    return past_underflow, normal, over


_EDGES = tuple(math.ldexp(1.0, k) for k in EXP_BINS[1:-1])  # interior histogram edges


def segment_stats(flat: torch.Tensor, lengths: Sequence[int], formats: Iterable[FormatLike]
                  ) -> list[tuple[dict[str, Coverage], list[int]]]:
    """Coverage in every format and the exponent histogram of each segment of a flat tensor.

    Every count is "how many |x| >= b" for boundaries b of the work dtype: one bucketize
    against the histogram edges and every format's cut points, then one bincount, on the
    tensor's own device. Only the small count table comes back to the host.
    """
    fmts = [get_format(f) for f in formats]
    work = get_format(flat.dtype)
    shared = (0.0, work.smallest_subnormal, math.inf)
    cuts = [_cut_points(f, work) for f in fmts]
    bnd = sorted({*shared, *(c for cs in cuts for c in cs), *_EDGES})
    where = {b: i for i, b in enumerate(bnd)}
    a = flat.abs()
    codes = torch.bucketize(a, torch.tensor(bnd, dtype=a.dtype, device=a.device), right=True,
                            out_int32=True)  # how many boundaries are <= |x|
    codes.masked_fill_(torch.isnan(a), 0)  # NaN is >= nothing
    width, nseg = len(bnd) + 1, len(lengths)
    finite = a <= work.max
    if nseg == 1:
        table = torch.bincount(codes, minlength=width)[None]
        ext = torch.stack([torch.where(finite, a, 0).amax(),
                           torch.where(finite & (a > 0), a, math.inf).amin()])[None]
    else:
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
    out = []
    for n, row in zip(lengths, rows):
        g = dict(zip(bnd, (int(v) for v in row[:-2])))
        amax, min_nz = row[-2:]
        g0, gtiny, ginf = (g[b] for b in shared)
        covs = {}
        for f, (pu, pn, po) in zip(fmts, cuts):
            covs[f.name] = Coverage(
                format=f.name, count=n, n_overflow=g[po] - ginf, n_underflow=gtiny - g[pu],
                n_subnormal=g[pu] - g[pn], n_normal=g[pn] - g[po], n_zero=g0 - gtiny,
                n_nonfinite=n - g0 + ginf, amax=amax if g0 > ginf else math.nan,
                min_nonzero=min_nz if gtiny > ginf else math.nan)
        levels = [gtiny, *(row[where[e]] for e in _EDGES), ginf]
        hist = [int(levels[k] - levels[k + 1]) for k in range(len(levels) - 1)]
        out.append((covs, hist))
    return out


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


def _pct(v: float) -> str:
    if v == 0:
        return "0"
    return f"{100 * v:.3g}%" if v >= 1e-5 else "<0.001%"


def coverage_table(rows: Iterable[Coverage], labels: Iterable[str] | None = None,
                   caption: str = "") -> Table:
    """Coverage records side by side as a deterministic table."""
    rows = list(rows)
    names = list(labels) if labels is not None else [c.format for c in rows]
    cells = [(name, *(_pct(getattr(c, k)) for k in CATEGORIES), f"{c.amax:.4g}",
              f"{c.min_nonzero:.4g}", c.count) for name, c in zip(names, rows)]
    return Table(("tensor" if labels is not None else "format", *CATEGORIES, "amax",
                  "min |x|>0", "elements"), cells, caption=caption)
