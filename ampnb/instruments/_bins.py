"""The shared log2 binning and each format's rounding cut points in a wider work dtype."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ampnb.formats import FloatFormat

# One binning for every exponent histogram: bin i holds |x| in [2**(EXP_MIN+i), 2**(EXP_MIN+i+1)).
# It spans fp32's subnormals (2**-149) to its overflow (2**128); fp64 values beyond land in
# the end bins.
EXP_MIN, EXP_MAX = -150, 128
EXP_BINS: tuple[int, ...] = tuple(range(EXP_MIN, EXP_MAX + 1))
HISTOGRAM_EDGES = tuple(math.ldexp(1.0, k) for k in EXP_BINS[1:-1])  # the interior edges

FormatLike = str | torch.dtype | FloatFormat


class Levels(NamedTuple):
    """The three levels every count table carries besides the formats' cut points."""

    zero: float     # how many |x| >= 0: every element but NaN
    tiniest: float  # ... >= float32's smallest subnormal: the nonzero ones
    inf: float      # ... >= inf: the infinite ones


SHARED_LEVELS = Levels(0.0, math.ldexp(1.0, -149), math.inf)
INF_BITS = 0x7F800000  # bits of float32 inf; NaNs lie above


class CutPoints(NamedTuple):
    """Where a format's rounding changes category, as values of the work dtype."""

    past_underflow: float  # smallest |x| that does not round to zero
    normal: float          # smallest |x| that rounds to a normal number
    overflow: float        # smallest |x| that rounds past the format's max


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


def cut_points(f: FloatFormat, work: FloatFormat) -> CutPoints:
    """Format f's cut points as values of the work dtype, so comparisons there are exact."""
    past_underflow = _next_up(_snap(f.underflow_threshold, work, up=False), work)
    normal = _snap(f.normal_threshold, work, up=True)
    ot = f.overflow_threshold
    if f.overflow_inclusive:
        over = _snap(ot, work, up=True)
    else:
        over = _next_up(_snap(ot, work, up=False), work)
    return CutPoints(past_underflow, normal, over)
