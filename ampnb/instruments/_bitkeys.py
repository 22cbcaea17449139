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
    thresholds: tuple[int, ...]          # sorted keys; class i holds keys in [t[i], t[i+1])
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
    t = sorted({*keys, *(k for c in strays for k in (2 * c, 2 * c + 1, 2 * c + 2))})
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
    """Class of every key (times scale), for per-segment counting."""
    keys = torch.arange(_KEYS, dtype=torch.int32)
    t = torch.tensor(plan.thresholds, dtype=torch.int32)
    return ((torch.bucketize(keys, t, right=True, out_int32=True) - 1) * scale).to(device)


_SCRATCH: dict[str, torch.Tensor] = {}
_SCRATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def _buffers(n: int, device: torch.device) -> Iterator[tuple[torch.Tensor, ...]]:
    """Three int32 work buffers of n elements. On CPU, up to _CHUNK elements, they are kept
    between calls: touching fresh memory costs more here than the passes themselves."""
    if device.type != "cpu" or n > _CHUNK or not _SCRATCH_LOCK.acquire(blocking=False):
        yield tuple(torch.empty(n, dtype=torch.int32, device=device) for _ in range(3))
        return
    try:
        if _SCRATCH.get("b") is None or _SCRATCH["b"].numel() < n:
            _SCRATCH.update({k: torch.empty(n, dtype=torch.int32) for k in "bkt"})
        yield tuple(_SCRATCH[k][:n] for k in "bkt")
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
    """Counts of key >= each threshold (a column), and the (amax, min |x|>0) bits, of one
    flat tensor."""
    n = x.numel()
    # With one thread a smaller chunk is ~1.4x faster here (its passes run from cache); with
    # more, each pass is shared out, and smaller chunks cost more in threads waiting.
    size = n if x.is_cuda else min(n, _CHUNK if torch.get_num_threads() > 1 else _CHUNK_SERIAL)
    with _buffers(size, x.device) as bufs:
        table, hi, lo = _count_chunks(x, bufs, _split_table(plan, x.device), absolute)
    # how many keys >= t = n - how many keys < t = n - cumsum[t - 1] (none below key 0)
    below = table.cumsum(0).index_select(0, _below_index(plan, x.device))
    if plan.thresholds[0] == 0:
        below[0] = 0
    return (n - below)[:, None], [hi, lo]


@functools.lru_cache(maxsize=16)
def _below_index(plan: _Plan, device: torch.device) -> torch.Tensor:
    """Per threshold t, the index of the cumulative key count just below it (t - 1)."""
    return torch.tensor([max(t - 1, 0) for t in plan.thresholds], device=device)


def _count_chunks(x: torch.Tensor, bufs: Sequence[torch.Tensor], splits: torch.Tensor,
                  absolute: bool = False) -> tuple[torch.Tensor, int, int]:
    """Key counts of x, a buffer-sized chunk at a time, and the bits of amax and min |x|>0.
    absolute: x already holds |x| (as staged by capture), so its bits are used as they are."""
    b, k, t = bufs
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


def _many_segments(x: torch.Tensor, lengths: Sequence[int], plan: _Plan,
                   absolute: bool = False) -> tuple[torch.Tensor, list[int]]:
    """The same for each short segment of a flat tensor (a column each): keys mapped to
    classes, counted by (class, segment) in one bincount."""
    nseg, nc, dev = len(lengths), len(plan.thresholds), x.device
    with _buffers(x.numel(), dev) as (b, k, t):
        if absolute and x.is_contiguous():  # (the extremes view it as a matrix)
            b = x.view(torch.int32)
        else:
            torch.bitwise_and(x.view(torch.int32), 0x7FFFFFFF, out=b)
        ext = _extremes(b, k, lengths)
        _keys(b, k, t, _split_table(plan, dev))
        # t = nseg * class + segment, for one bincount over (class, segment): class-major, so
        # that picking values' rows later copies rows. A training loop sees the same
        # segments at every step: their indices are cached (up to a few MB).
        torch.index_select(_classes(plan, dev, nseg), 0, k, out=t)
        lens = tuple(lengths)
        t.add_(_segments(lens, dev) if x.numel() <= _CACHED else _segments.__wrapped__(lens, dev))
        cls = torch.bincount(t, minlength=nseg * nc).view(nc, nseg)
    return cls.flip(0).cumsum(0).flip(0), ext


def _extremes(b: torch.Tensor, scratch: torch.Tensor, lengths: Sequence[int]) -> list[int]:
    """Per segment the bits of (amax, min |x|>0) of |x|'s bits b. Back-to-back segments of one
    length are reduced together, as the rows of one matrix (callers order segments by
    length): a call per length, not per segment. Only a segment holding inf or NaN takes
    one more pass."""
    # (b - 1) ^ 0x7FFFFFFF = 2**31 - b for b > 0 (larger for smaller |x|), int32's min for 0
    torch.sub(b, 1, out=scratch).bitwise_xor_(0x7FFFFFFF)
    his, los, at, pos = [], [], [], 0
    for n, same in itertools.groupby(lengths):
        m = len(list(same))
        his.append(b[pos:pos + m * n].view(m, n).amax(1))
        los.append(scratch[pos:pos + m * n].view(m, n).amax(1))
        at.extend(range(pos, pos + m * n, n))
        pos += m * n
    found = torch.cat(his + los).tolist()
    k = len(lengths)
    ext = []
    for i in range(k):
        hi = found[i]
        if hi >= _INF_BITS:
            hi = _finite_max(b[at[i]:at[i] + lengths[i]])
        ext += [hi, (1 << 31) - found[k + i]]
    return ext


_CACHED = 1 << 20  # elements: segment indices of runs up to this long are cached


@functools.lru_cache(maxsize=4)
def _segments(lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The segment of each element, int32 (making them costs more than adding them)."""
    return torch.repeat_interleave(
        torch.arange(len(lengths), dtype=torch.int32, device=device),
        torch.tensor(lengths, device=device), output_size=sum(lengths))


_ALONE = 1 << 16  # a segment this long is counted on its own (its bincount is no overhead)


def count_segments(x: torch.Tensor, lengths: Sequence[int], plan: _Plan,
                   absolute: bool = False) -> tuple[torch.Tensor, list[int]]:
    """g[j, s] = how many |x| >= plan.values[j] in each segment s of a flat float32 tensor,
    and per segment the bits of (amax, min |x|>0). A long segment is counted alone; runs of short
    ones together, up to _CHUNK elements a pass (slices of x: nothing is copied)."""
    runs: list[tuple[int, int]] = []  # [first, last) segment indices
    size = 0
    for i, n in enumerate(lengths):
        alone = n >= _ALONE or len(lengths) == 1
        if alone or not runs or runs[-1][1] != i or size + n > _CHUNK or runs[-1][2]:
            runs.append([i, i + 1, alone])
            size = 0
        else:
            runs[-1][1] = i + 1
        size += n
    starts = list(itertools.accumulate([0, *lengths]))
    rows, ext = [], []
    for first, last, alone in runs:
        part, lens = x[starts[first]:starts[last]], lengths[first:last]
        ge, e = _one_segment(part, plan, absolute) if alone else \
            _many_segments(part, lens, plan, absolute)
        rows.append(_value_counts(part, lens, plan, ge))
        ext.extend(e)
    return (torch.cat(rows, dim=1) if len(rows) > 1 else rows[0]), ext


def _value_counts(x: torch.Tensor, lengths: Sequence[int], plan: _Plan, ge: torch.Tensor
                  ) -> torch.Tensor:
    """How many |x| >= v for every value of the plan, per segment: key counts, plus one masked
    pass over a straggler's cell in the segments that have elements there."""
    g = ge.index_select(0, _cols(plan, ge.device))
    if not plan.stragglers:
        return g
    first, above = _held_cols(plan, ge.device)
    held = (ge.index_select(0, first) - ge.index_select(0, above)).t().tolist()
    if not any(map(any, held)):  # the usual case: no element in any straggler's cell
        return g
    starts = list(itertools.accumulate([0, *lengths]))
    for j, (cell, idx) in enumerate(plan.stragglers):
        idx = sorted(idx, key=lambda i: plan.values[i])
        bounds = torch.tensor([_bits(plan.values[i]) for i in idx], dtype=torch.int32,
                              device=x.device)
        for s in (s for s in range(len(lengths)) if held[s][j]):
            b = x[starts[s]:starts[s + 1]].view(torch.int32) & 0x7FFFFFFF
            inside = b[(b >> _LOW) == cell]
            below = torch.bucketize(inside, bounds, right=True)  # how many bounds are <= b
            per = torch.bincount(below, minlength=len(idx) + 1)
            g[idx, s] += per.flip(0).cumsum(0).flip(0)[1:]  # how many b >= each bound
    return g


@functools.lru_cache(maxsize=16)
def _cols(plan: _Plan, device: torch.device) -> torch.Tensor:
    """Per value of the plan, the row of its threshold in the counts."""
    return torch.tensor(plan.cols, device=device)


@functools.lru_cache(maxsize=16)
def _held_cols(plan: _Plan, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Columns of the key counts whose difference is how many elements each straggler's cell
    holds at or above its lowest key that needs the masked pass."""
    return (torch.tensor([plan.col(_first_key(plan, c, ix)) for c, ix in plan.stragglers],
                         device=device),
            torch.tensor([plan.col(2 * c + 2) for c, _ in plan.stragglers], device=device))


def _first_key(plan: _Plan, cell: int, idx: Sequence[int]) -> int:
    """The lowest key of a cell that can hold elements at or above one of its stragglers."""
    split = dict(plan.splits).get(cell, 1)
    low = min(_bits(plan.values[i]) & ((1 << _LOW) - 1) for i in idx)
    return 2 * cell + (low >= split)  # in cell 0, say, zeros never need the masked pass


@functools.lru_cache(maxsize=64)
def _levels(plan: _Plan, device: torch.device
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Indices into plan.values of each histogram bin's lower and upper edge, and of the
    shared values (0, float32's tiniest, inf)."""
    at = {v: i for i, v in enumerate(plan.values)}
    lev = torch.tensor([at[_SHARED[1]], *(at[e] for e in _EDGES), at[_SHARED[2]]], device=device)
    return lev[:-1], lev[1:], torch.tensor([at[v] for v in _SHARED], device=device)
