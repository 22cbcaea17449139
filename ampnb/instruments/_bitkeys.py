"""Coverage counts of float32 tensors from their bit patterns: one 16-bit key per element, one bincount.

With b the bits of |x|, cell(x) = b >> 16 (exponent and 7 mantissa bits) and
key(x) = 2 * cell + (low 16 bits >= split[cell]). Every cell has one split point: by default 1
("any low bit set"), which makes "|x| > a power of two" exact (fp8 and fp16 underflow, e4m3
overflow); where a format rounds inside a cell (fp16's 65520, bf16's half-ulps) the split is
there. A value on neither a cell start nor its cell's split is a straggler, counted by one
masked pass over its cell's elements, and only when that cell holds any (in practice: float32
subnormals, and values within 0.4 % of float32's max when tf32 and bf16 are asked together).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import struct
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ampnb.formats import FloatFormat, get_format
from ampnb.instruments._bins import _EDGES, _INF_BITS, _SHARED, _cut_points

_CHUNK = 1 << 22        # elements per pass on CPU, at most: buffers stay small and are reused
_CHUNK_SERIAL = 1 << 20  # with one torch thread: the three work buffers then stay in cache
_LOW = 16               # bits below the cell number
_KEYS = 1 << 16         # 2 keys for each of the 2**15 cells of |x|'s 31 bits


def _bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


@dataclass(frozen=True, eq=False)  # hashed by identity: one per format set (cached)
class _Plan:
    """The keys one set of formats needs, and how to read every count from them."""

    values: tuple[float, ...]            # how many |x| >= v is wanted for each of these
    head: int                            # values[:head]: the shared ones and the formats' cuts
    thresholds: tuple[int, ...]          # sorted keys; class i holds keys in [t[i], t[i+1]);
    #                                      the last is past every key: its count is always 0
    cols: tuple[int, ...]                # per value: its threshold (stragglers: next cell's)
    splits: tuple[tuple[int, int], ...]  # (cell, low bits) where the split is not 1
    stragglers: tuple[tuple[int, tuple[int, ...]], ...]  # (cell, indices into values)
    cuts: tuple[tuple[float, ...], ...]  # per format: past underflow, normal, overflow

    def col(self, key: int) -> int:
        return self.thresholds.index(key)


@functools.lru_cache(maxsize=64)
def _plan(fmts: tuple[FloatFormat, ...]) -> _Plan:
    work = get_format(torch.float32)
    cuts = tuple(_cut_points(f, work) for f in fmts)
    head = tuple(dict.fromkeys((*_SHARED, *(c for cs in cuts for c in cs))))
    values = (*head, *(e for e in _EDGES if e not in head))
    split = {0: 1}  # cell 0 splits zeros from the rest, so zeros are always counted exactly
    for v in values:
        cell, low = divmod(_bits(v), 1 << _LOW)
        if low:
            split.setdefault(cell, low)  # first come: the formats' own order decides
    keys, strays = [], {}
    for i, v in enumerate(values):
        cell, low = divmod(_bits(v), 1 << _LOW)
        if low == 0 or split[cell] == low:
            keys.append(2 * cell + (low != 0))
        else:
            keys.append(2 * cell + 2)  # the count above its cell; the masked pass adds the rest
            strays.setdefault(cell, []).append(i)
    t = sorted({*keys, *(k for c in strays for k in (2 * c, 2 * c + 1, 2 * c + 2)), _KEYS})
    index = {k: i for i, k in enumerate(t)}
    return _Plan(values, len(head), tuple(t), tuple(index[k] for k in keys),
                 tuple((c, s) for c, s in split.items() if s != 1),
                 tuple((c, tuple(ix)) for c, ix in strays.items()), cuts)


@functools.lru_cache(maxsize=16)
def _split_table(plan: _Plan, device: torch.device) -> torch.Tensor:
    """Each cell's split point as the bits of |x| it starts at (int32, 2**15 entries): one
    compare of the whole bits then decides the key, with no masking of the low bits first."""
    table = torch.arange(_KEYS // 2, dtype=torch.int32) * (1 << _LOW) + 1
    for cell, low in plan.splits:
        table[cell] = (cell << _LOW) + low
    return table.to(device)


@functools.lru_cache(maxsize=16)
def _classes(plan: _Plan, device: torch.device, scale: int = 1) -> torch.Tensor:
    """Class of every key, numbered from the top threshold down (times scale), for
    per-segment counting: one cumsum over classes then gives how many keys >= each threshold,
    in the order of _row."""
    keys = torch.arange(_KEYS, dtype=torch.int32)
    t = torch.tensor(plan.thresholds, dtype=torch.int32)
    below = torch.bucketize(keys, t, right=True, out_int32=True) - 1
    return ((len(plan.thresholds) - 1 - below) * scale).to(device)


def _row(plan: _Plan, col: int) -> int:
    """Row of threshold col in a table of counts "how many keys >= threshold": every such
    table runs from the top threshold down (row 0: the one past every key, always 0)."""
    return len(plan.thresholds) - 1 - col


class _Work(NamedTuple):
    """Three int32 work buffers of n elements, and views of them that the passes need."""

    b: torch.Tensor
    k: torch.Tensor
    t: torch.Tensor
    rows: torch.Tensor | None  # b and k as (2, n // _ROW, _ROW), when n is whole rows
    f: torch.Tensor            # b's memory as float32


def _work(memory: torch.Tensor, n: int) -> _Work:
    """The work buffers of n elements at the start of memory (3 * n int32 or more)."""
    three = memory[:3 * n].view(3, n)
    b, k, t = three.unbind()
    return _Work(b, k, t, three[:2].view(2, -1, _ROW) if n % _ROW == 0 else None,
                 b.view(torch.float32))


_MEMORY: list[torch.Tensor] = []  # kept work memory, on CPU
_VIEWS: dict[int, _Work] = {}     # per n, views of it
_SCRATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def _buffers(n: int, device: torch.device) -> Iterator[_Work]:
    """Work buffers of n elements. On CPU, up to _CHUNK elements, the memory is kept between
    calls (touching fresh memory costs more here than the passes themselves), and so are its
    views for each n (a training loop asks for the same sizes at every step: making views
    costs a few torch calls each time, and those add up on a small model)."""
    if device.type != "cpu" or n > _CHUNK or not _SCRATCH_LOCK.acquire(blocking=False):
        yield _work(torch.empty(3 * n, dtype=torch.int32, device=device), n)
        return
    try:
        work = _VIEWS.get(n)
        if work is None:
            if not _MEMORY or _MEMORY[0].numel() < 3 * n:
                _MEMORY[:] = [torch.empty(3 * n, dtype=torch.int32)]
                _VIEWS.clear()  # views of the old memory
            elif len(_VIEWS) >= 16:
                _VIEWS.clear()
            work = _VIEWS[n] = _work(_MEMORY[0], n)
        yield work
    finally:
        _SCRATCH_LOCK.release()


def _keys(b: torch.Tensor, k: torch.Tensor, t: torch.Tensor, splits: torch.Tensor) -> None:
    """k = key(x) from b = bits of |x| (left as it was); t is scratch. Four passes: every
    pass over memory counts, since the whole job is a few passes and one bincount."""
    torch.bitwise_right_shift(b, _LOW, out=k)
    torch.index_select(splits, 0, k, out=t)
    torch.ge(b, t, out=t)
    torch.add(t, k, alpha=2, out=k)


_SIGN = -(1 << 31)  # int32's sign bit: XOR with it turns a signed order into an unsigned one


def _finite_max(b: torch.Tensor, out: torch.Tensor | None = None) -> int:
    """Largest bits of |x| below inf's (negative if none): b - inf, with the sign bit flipped,
    puts every inf/NaN below every finite value; two plain passes, no boolean mask."""
    t = torch.sub(b, _INF_BITS, out=out)
    return int(t.bitwise_xor_(_SIGN).amax()) + _SIGN + _INF_BITS


def _nonzero_min(b: torch.Tensor, out: torch.Tensor | None = None) -> int:
    """Smallest nonzero bits of |x| (>= inf's if none): b - 1, with the sign bit flipped,
    puts zeros above everything; NaN and inf stay >= inf's bits, so never below a value."""
    t = torch.sub(b, 1, out=out)
    return int(t.bitwise_xor_(_SIGN).amin()) - _SIGN + 1


def _one_segment(x: torch.Tensor, plan: _Plan, absolute: bool = False
                 ) -> tuple[torch.Tensor, list[int]]:
    """Counts of key >= each threshold (a column, in _row order), and the (amax, min |x|>0)
    bits, of one flat tensor."""
    n = x.numel()
    # With one thread a smaller chunk is ~1.4x faster here (its passes run from cache); with
    # more, each pass is shared out, and smaller chunks cost more in threads waiting.
    size = n if x.is_cuda else min(n, _CHUNK if torch.get_num_threads() > 1 else _CHUNK_SERIAL)
    with _buffers(size, x.device) as bufs:
        table, hi, lo = _count_chunks(x, bufs, _split_table(plan, x.device), absolute)
    # how many keys >= t = n - how many keys < t = n - cumsum[t - 1] (none below key 0)
    below = table.cumsum(0).index_select(0, _below_index(plan, x.device))
    below[-1] = 0  # threshold 0 (the last row), which every key is at or above
    return (n - below)[:, None], [hi, lo]


@functools.lru_cache(maxsize=16)
def _below_index(plan: _Plan, device: torch.device) -> torch.Tensor:
    """Per threshold t, in _row order, the index of the cumulative key count just below it."""
    return torch.tensor([max(t - 1, 0) for t in reversed(plan.thresholds)], device=device)


def _count_chunks(x: torch.Tensor, bufs: _Work, splits: torch.Tensor,
                  absolute: bool = False) -> tuple[torch.Tensor, int, int]:
    """Key counts of x, a buffer-sized chunk at a time, and the bits of amax and min |x|>0.
    absolute: x already holds |x| (as staged by capture), so its bits are used as they are."""
    b, k, t = bufs.b, bufs.k, bufs.t
    n, size = x.numel(), b.numel()
    table, hi, lo = None, -1, _INF_BITS
    for s in range(0, n, size):
        part = x[s:s + size]
        bb, kk, tt = b[:part.numel()], k[:part.numel()], t[:part.numel()]
        if absolute:
            bb = part.view(torch.int32)
        else:
            torch.bitwise_and(part.view(torch.int32), 0x7FFFFFFF, out=bb)
        cmin, cmax = (int(v) for v in torch.aminmax(bb))
        # Exact extremes cost a masked pass only where zeros or inf/NaN are present.
        hi = max(hi, cmax if cmax < _INF_BITS else _finite_max(bb, kk))
        lo = min(lo, cmin if cmin > 0 else _nonzero_min(bb, kk))
        _keys(bb, kk, tt, splits)
        counts = _bincount(kk)
        table = counts if table is None else table.add_(counts)
    return table, hi, lo


# One worker thread per process, made on first use (a forked child gets its own: the
# parent's thread does not exist there).
_POOL: dict[int, object] = {}


def _bincount(k: torch.Tensor) -> torch.Tensor:
    """bincount of keys. torch's CPU bincount is one serial loop: with more than one torch
    thread, half of a large chunk is counted on a second thread meanwhile."""
    if k.is_cuda or k.numel() < 1 << 20 or torch.get_num_threads() < 2:
        return torch.bincount(k, minlength=_KEYS)
    pool = _POOL.get(os.getpid())
    if pool is None:
        from concurrent.futures import ThreadPoolExecutor
        pool = _POOL.setdefault(os.getpid(), ThreadPoolExecutor(1, "ampnb-bincount"))
    half = k.numel() // 2
    other = pool.submit(torch.bincount, k[half:], minlength=_KEYS)
    return torch.bincount(k[:half], minlength=_KEYS).add_(other.result())


def _many_segments(parts: Sequence[torch.Tensor], plan: _Plan, absolute: bool = False
                   ) -> tuple[torch.Tensor, list[int]]:
    """The same for each of some short flat tensors (a column each), joined in one buffer:
    keys mapped to classes, counted by (class, segment) in one bincount."""
    nseg, nc, dev = len(parts), len(plan.thresholds), parts[0].device
    lay = _layout(tuple(p.numel() for p in parts), dev, parts[0].dtype)
    with _buffers(lay.size, dev) as work:
        b, k, t, rows, f = work
        # Each segment starts on a row of _ROW elements, zeros after it up to the next row.
        torch.cat([x for pair in zip(parts, lay.pads) for x in pair], out=f)
        if not absolute:
            b.bitwise_and_(0x7FFFFFFF)
        ext = _extremes(b, k, rows, lay)
        _keys(b, k, t, _split_table(plan, dev))
        # t = (nseg + 1) * class + segment, for one bincount over (class, segment); padding
        # is segment nseg, dropped. Class-major, so that picking rows later copies rows.
        torch.index_select(_classes(plan, dev, nseg + 1), 0, k, out=t)
        t.add_(lay.segment)
        cls = torch.bincount(t, minlength=(nseg + 1) * nc).view(nc, nseg + 1)[:, :nseg]
    return cls.cumsum(0), ext


_ROW = 64  # elements: short segments are joined on rows of this many, so rows reduce together


class _Layout(NamedTuple):
    """Where each of some short segments lies once joined on rows (cached per lengths: a
    training loop sees the same segments at every step)."""

    size: int                         # elements, padding included
    lengths: tuple[int, ...]
    starts: tuple[int, ...]
    pads: tuple[torch.Tensor, ...]    # zeros that fill each segment's last row
    segment: torch.Tensor             # int32, per element: its segment (padding: nseg)
    rows: torch.Tensor                # int64 (2, size // _ROW): each row's segment, twice
    zeros: torch.Tensor               # int32 (2, segments)


_CACHED = 1 << 20  # elements: layouts of runs up to this long are cached


def _layout(lengths: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> _Layout:
    return (_cached_layout if sum(lengths) <= _CACHED else _make_layout)(lengths, device, dtype)


def _make_layout(lengths: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> _Layout:
    """The _Layout of segments of these lengths (making it costs more than using it)."""
    rows = [-(-n // _ROW) for n in lengths]
    pads = [r * _ROW - n for n, r in zip(lengths, rows)]
    nseg, zeros = len(lengths), torch.zeros(_ROW, dtype=dtype, device=device)
    ids = torch.arange(nseg, dtype=torch.int32, device=device)
    spans = torch.tensor([c for n, p in zip(lengths, pads) for c in (n, p)], device=device)
    segment = torch.repeat_interleave(
        torch.stack([ids, torch.full_like(ids, nseg)], 1).ravel(), spans,
        output_size=sum(lengths) + sum(pads))
    row_of = torch.repeat_interleave(ids.long(), torch.tensor(rows, device=device),
                                     output_size=sum(rows))
    starts = tuple(_ROW * r for r in itertools.accumulate([0, *rows[:-1]]))
    return _Layout(_ROW * sum(rows), lengths, starts, tuple(zeros[:p] for p in pads), segment,
                   row_of.expand(2, -1), torch.zeros(2, nseg, dtype=torch.int32, device=device))


_cached_layout = functools.lru_cache(maxsize=4)(_make_layout)


def _extremes(b: torch.Tensor, s: torch.Tensor, rows: torch.Tensor, lay: _Layout) -> list[int]:
    """Per segment the bits of (amax, min |x|>0), from b = bits of |x| joined on rows, and
    scratch s (rows: both as (2, rows, _ROW)): a reduction per row for both, then the rows'
    results by segment. Only a segment holding inf or NaN takes one more pass."""
    # (b - 1) ^ 0x7FFFFFFF = 2**31 - b for b > 0 (larger for smaller |x|), int32's min for 0
    torch.sub(b, 1, out=s).bitwise_xor_(0x7FFFFFFF)
    # (from 0: every b >= 0, and an all-zero segment's min is then past any value: none)
    his, los = torch.scatter_reduce(lay.zeros, 1, lay.rows, rows.amax(2), "amax").tolist()
    ext = []
    for i, (hi, lo) in enumerate(zip(his, los)):
        if hi >= _INF_BITS:
            start = lay.starts[i]
            hi = _finite_max(b[start:start + lay.lengths[i]])
        ext += [hi, (1 << 31) - lo]
    return ext


_ALONE = 1 << 16  # a segment this long is counted on its own (its bincount is no overhead)


class Counts(NamedTuple):
    """What count_segments finds, per segment."""

    table: torch.Tensor          # (segments, head + bins): how many |x| >= each of the plan's
    #                              first head values, then the histogram's counts per bin
    shared: list[list[int]]      # how many |x| >= 0, float32's tiniest value, inf: a
    #                              list each, over the segments
    extremes: list[int]          # bits of amax, min |x|>0, amax, ... (past inf's: none)


def count_segments(parts: Sequence[torch.Tensor], plan: _Plan, absolute: bool = False) -> Counts:
    """The counts of each flat float32 tensor of parts. A long one is counted alone; runs of
    short ones together, up to _CHUNK elements a pass."""
    runs: list[list] = []  # [first, last) indices into parts, and whether counted alone
    size = 0
    for i, p in enumerate(parts):
        n = p.numel()
        alone = n >= _ALONE or len(parts) == 1
        if alone or not runs or runs[-1][2] or size + n + _ROW > _CHUNK:
            runs.append([i, i + 1, alone])
            size = 0
        else:
            runs[-1][1] = i + 1
        size += n + _ROW  # (at most: its padding is less than a row)
    ges, ext = [], []
    for first, last, alone in runs:
        ge, e = _one_segment(parts[first], plan, absolute) if alone else \
            _many_segments(parts[first:last], plan, absolute)
        ges.append(ge)
        ext.extend(e)
    ge = torch.cat(ges, dim=1) if len(ges) > 1 else ges[0]  # threshold rows, segment columns
    ix = _indices(plan, ge.device)
    # One small transfer: the shared counts, and whether a straggler's cell holds anything.
    small = ge.index_select(0, ix.small).tolist()
    shared, k = small[:3], len(plan.stragglers)
    held = [[a - b for a, b in zip(*pair)] for pair in zip(small[3:3 + k], small[3 + k:])]
    if any(map(any, held)):  # elements in a straggler's cell: count them exactly
        g = _value_counts(parts, plan, ge.index_select(0, ix.cols), held)
        table = g.index_select(0, ix.value_plus) - g.index_select(0, ix.value_minus)
    else:  # the usual case: every value's count is a threshold's
        table = ge.index_select(0, ix.plus) - ge.index_select(0, ix.minus)
    return Counts(table.t(), shared, ext)


def _value_counts(parts: Sequence[torch.Tensor], plan: _Plan, g: torch.Tensor,
                  held: list[list[int]]) -> torch.Tensor:
    """g (how many |x| >= v for every value of the plan, per segment, from key counts), plus
    one masked pass over a straggler's cell in the segments that have elements there."""
    for j, (cell, idx) in enumerate(plan.stragglers):
        idx = sorted(idx, key=lambda i: plan.values[i])
        bounds = torch.tensor([_bits(plan.values[i]) for i in idx], dtype=torch.int32,
                              device=g.device)
        for s in (s for s in range(len(parts)) if held[j][s]):
            b = parts[s].view(torch.int32) & 0x7FFFFFFF
            inside = b[(b >> _LOW) == cell]
            below = torch.bucketize(inside, bounds, right=True)  # how many bounds are <= b
            per = torch.bincount(below, minlength=len(idx) + 1)
            g[idx, s] += per.flip(0).cumsum(0).flip(0)[1:]  # how many b >= each bound
    return g


class _Indices(NamedTuple):
    """Rows picked from a table of threshold counts (cached per plan and device)."""

    small: torch.Tensor        # the shared values', then each straggler's first and above
    cols: torch.Tensor         # every value's threshold row, then the always-0 row
    plus: torch.Tensor         # table = rows plus - rows minus: head values, then bins
    minus: torch.Tensor
    value_plus: torch.Tensor   # the same, as rows of the value counts picked by cols
    value_minus: torch.Tensor


@functools.lru_cache(maxsize=16)
def _indices(plan: _Plan, device: torch.device) -> _Indices:
    """The rows count_segments picks, for this plan, as index tensors on the device."""
    at = {v: i for i, v in enumerate(plan.values)}
    rows = [_row(plan, c) for c in plan.cols]
    zero = len(plan.values)  # the row cols adds: threshold row 0, always 0
    # a bin's count = how many >= its lower edge - how many >= its upper edge
    levels = [at[_SHARED[1]], *(at[e] for e in _EDGES), at[_SHARED[2]]]
    vplus = [*range(plan.head), *levels[:-1]]
    vminus = [zero] * plan.head + levels[1:]
    first = [_row(plan, plan.col(_first_key(plan, c, ix))) for c, ix in plan.stragglers]
    above = [_row(plan, plan.col(2 * c + 2)) for c, _ in plan.stragglers]
    cols = [*rows, 0]

    def tensor(v: list[int]) -> torch.Tensor:
        return torch.tensor(v, device=device)

    return _Indices(tensor([rows[at[v]] for v in _SHARED] + first + above), tensor(cols),
                    tensor([cols[i] for i in vplus]), tensor([cols[i] for i in vminus]),
                    tensor(vplus), tensor(vminus))


def _first_key(plan: _Plan, cell: int, idx: Sequence[int]) -> int:
    """The lowest key of a cell that can hold elements at or above one of its stragglers."""
    split = dict(plan.splits).get(cell, 1)
    low = min(_bits(plan.values[i]) & ((1 << _LOW) - 1) for i in idx)
    return 2 * cell + (low >= split)  # in cell 0, say, zeros never need the masked pass
