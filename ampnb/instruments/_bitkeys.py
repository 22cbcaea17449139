"""Coverage counts of float32 tensors from their bit patterns: one key per element, one bincount."""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import struct
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from ampnb.formats import FloatFormat, get_format
from ampnb.instruments._bins import _EDGES, _F, _INF_BITS, _SHARED, EXP_MIN, _cut_points

_CHUNK = 1 << 22  # elements per pass on CPU: buffers stay small and are reused


def _bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def _value(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _grid(v: float) -> int | None:
    """k with |x| >= v <=> key(x) >= k, for float32 v >= 0 (None where v is off the key's grid).

    key(x) = 2 * (bits(|x|) >> 12) + (low 12 bits != 0): thresholds of both kinds, at a
    value with 11 mantissa bits ("|x| >= A") and one ulp above it ("|x| > A"), fall on it.
    """
    m, r = divmod(_bits(v), _F)
    return 2 * m + r if r <= 1 else None


@dataclass(frozen=True, eq=False)  # hashed by identity: one per format set (cached)
class _Plan:
    """The thresholds (in key space) that one set of formats needs, and how to read them."""

    thresholds: tuple[int, ...]          # sorted; class i holds keys in [t[i], t[i+1])
    cuts: tuple[tuple[float, ...], ...]  # per format: past underflow, normal, overflow
    cols: dict[float, int]               # value -> index into thresholds
    levels: tuple[int, ...]              # threshold indices of the histogram's level list


@functools.lru_cache(maxsize=64)
def _plan(fmts: tuple[FloatFormat, ...]) -> _Plan | None:
    work = get_format(torch.float32)
    cuts = tuple(_cut_points(f, work) for f in fmts)
    values = {*_SHARED, *(c for cs in cuts for c in cs)}
    if any(_grid(v) is None for v in values):
        return None  # a format with a threshold finer than the key: take the general path
    # Histogram edges under 2**-137 are off the grid; such tiny values are counted apart.
    edges = {e: _grid(e) if _grid(e) is not None else _grid(2.0**-137) for e in _EDGES}
    t = sorted({_grid(v) for v in values} | set(edges.values()) | {_grid(2.0**-137)})
    index = {k: i for i, k in enumerate(t)}
    cols = {v: index[_grid(v)] for v in values}
    levels = (cols[_SHARED[1]], *(index[edges[e]] for e in _EDGES), cols[math.inf])
    return _Plan(tuple(t), cuts, cols, levels)


@functools.lru_cache(maxsize=16)
def _lut(thresholds: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Class of every key (2**20 of them), for per-segment counting."""
    keys = torch.arange(1 << 20, dtype=torch.int32)
    t = torch.tensor(thresholds, dtype=torch.int32)
    return (torch.bucketize(keys, t, right=True, out_int32=True) - 1).to(device)


@functools.lru_cache(maxsize=64)
def _columns(plan: _Plan, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Index tensors: histogram levels (upper, lower) and the cut columns, in plan.cols order."""
    lev = torch.tensor(plan.levels, device=device)
    return lev[:-1], lev[1:], torch.tensor(list(plan.cols.values()), device=device)


_SCRATCH: dict[str, torch.Tensor] = {}
_SCRATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def _buffers(n: int, device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Two int32 work buffers of n elements. On CPU, up to _CHUNK elements, they are kept
    between calls: touching fresh memory costs more here than the passes themselves."""
    if device.type != "cpu" or n > _CHUNK or not _SCRATCH_LOCK.acquire(blocking=False):
        yield tuple(torch.empty(n, dtype=torch.int32, device=device) for _ in range(2))
        return
    try:
        if _SCRATCH.get("b") is None or _SCRATCH["b"].numel() < n:
            _SCRATCH.update(b=torch.empty(n, dtype=torch.int32),
                            k=torch.empty(n, dtype=torch.int32))
        yield _SCRATCH["b"][:n], _SCRATCH["k"][:n]
    finally:
        _SCRATCH_LOCK.release()


def _keys(b: torch.Tensor, k: torch.Tensor) -> None:
    """k = key(x) (see _grid) from b = bits of |x|; b is left holding the low-bits flag."""
    torch.bitwise_right_shift(b, 12, out=k)
    b.bitwise_and_(_F - 1).clamp_(max=1)
    torch.add(b, k, alpha=2, out=k)


def _finite_max(b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    other = torch.tensor(-1, dtype=b.dtype, device=b.device)
    return torch.where(b < _INF_BITS, b, other, out=out)  # nonfinite (bits >= inf) never count


def _nonzero_min(b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    inf = torch.tensor(_INF_BITS, dtype=b.dtype, device=b.device)
    return torch.where(b == 0, inf, b, out=out)  # NaN and inf are >= this: never below


def _one_segment(x: torch.Tensor, plan: _Plan) -> tuple[torch.Tensor, list[int]]:
    """Counts of key >= each threshold, and the (amax, min |x|>0) bits, of one flat tensor."""
    n = x.numel()
    size = n if x.is_cuda else min(n, _CHUNK)
    with _buffers(size, x.device) as (b, k):
        table, hi, lo = _count_chunks(x, b, k)
    below = torch.cat([table.new_zeros(1), table.cumsum(0)])  # below[k] = how many keys < k
    ge = n - below[torch.tensor(plan.thresholds, device=x.device)]
    return ge[None], [hi, lo]


def _count_chunks(x: torch.Tensor, b: torch.Tensor, k: torch.Tensor
                  ) -> tuple[torch.Tensor, int, int]:
    """Key counts of x, a buffer-sized chunk at a time, and the bits of amax and min |x|>0."""
    n, size = x.numel(), b.numel()
    table, hi, lo = None, -1, _INF_BITS
    for s in range(0, n, size):
        part = x[s:s + size]
        bb, kk = b[:part.numel()], k[:part.numel()]
        torch.bitwise_and(part.view(torch.int32), 0x7FFFFFFF, out=bb)
        cmin, cmax = (int(v) for v in torch.aminmax(bb))
        # Exact extremes cost a masked pass only where zeros or inf/NaN are present.
        hi = max(hi, cmax if cmax < _INF_BITS else int(_finite_max(bb, kk).amax()))
        lo = min(lo, cmin if cmin > 0 else int(_nonzero_min(bb, kk).amin()))
        _keys(bb, kk)
        counts = torch.bincount(kk, minlength=1 << 20)
        table = counts if table is None else table.add_(counts)
    return table, hi, lo


def _many_segments(x: torch.Tensor, lengths: Sequence[int], plan: _Plan
                   ) -> tuple[torch.Tensor, list[int]]:
    """The same for each segment of a flat tensor: keys mapped to classes, counted per segment."""
    nseg, nc, dev = len(lengths), len(plan.thresholds), x.device
    starts = list(itertools.accumulate([0, *lengths]))
    with _buffers(x.numel(), dev) as (b, k):
        torch.bitwise_and(x.view(torch.int32), 0x7FFFFFFF, out=b)
        # Per segment (max, min) of |x|'s bits; redone masked where zeros or inf/NaN spoil them.
        ext = torch.stack([v for s, e in zip(starts, starts[1:])
                           for v in reversed(torch.aminmax(b[s:e]))]).tolist()
        for i in range(nseg):
            if ext[2 * i] >= _INF_BITS or ext[2 * i + 1] == 0:
                part = b[starts[i]:starts[i + 1]]
                ext[2 * i] = int(_finite_max(part).amax())
                ext[2 * i + 1] = int(_nonzero_min(part).amin())
        _keys(b, k)
        torch.index_select(_lut(plan.thresholds, dev), 0, k, out=b)  # b: each element's class
        # One bincount per segment: cheaper than building per-element segment offsets.
        cls = torch.stack([torch.bincount(b[s:e], minlength=nc)
                           for s, e in zip(starts, starts[1:])])
    return cls.flip(1).cumsum(1).flip(1), ext


def _tiny_histograms(x: torch.Tensor, lengths: Sequence[int]) -> list[list[int]]:
    """Exact floor(log2|x|) counts (bins 0..12) of subnormals under 2**-137, per segment."""
    out = []
    for s, n in zip(itertools.accumulate([0, *lengths]), lengths):
        a = x[s:s + n].abs()
        tiny = a[(a > 0) & (a < 2.0**-137)]
        e = torch.frexp(tiny)[1].long() - 1 - EXP_MIN
        out.append(torch.bincount(e, minlength=13).tolist())
    return out
