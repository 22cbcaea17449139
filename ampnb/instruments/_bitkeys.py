"""Coverage counts of float32 tensors from their bit patterns: one 16-bit key per element, one bincount.

Which keys, and where each count is read from their counts: _keyplan. Where the passes work:
_scratch. A long segment is counted alone, a chunk at a time; a run of short ones is joined on
rows and counted by one bincount over (class, segment); a level inside a key (a straggler) is
counted by one masked pass over its cell, only where that cell holds elements.

What is kept between calls (a training loop counts the same shapes at every step):
  key_plan(formats)                   per format set                     (_keyplan)
  plan_tensors(plan, device)          a plan's tables on each device     (_keyplan)
  row_layout(lengths, device, dtype)  short segments joined on rows      (_scratch)
  work_buffers(n, device)             the int32 work memory, CPU only    (_scratch)
  _BINCOUNT_WORKERS                   one bincount thread per process    (here)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch

from ampnb.instruments._bins import INF_BITS, Levels
from ampnb.instruments._keyplan import LOW_BITS, N_KEYS, KeyPlan, float_bits, plan_tensors
from ampnb.instruments._scratch import ROW, RowLayout, WorkBuffers, row_layout, work_buffers

CHUNK = 1 << 22             # elements per pass on CPU, at most: buffers stay small and reused
CHUNK_ONE_THREAD = 1 << 20  # with one torch thread: the three work buffers then stay in cache
ALONE = 1 << 16             # a segment this long is counted on its own (its bincount is no
#                             overhead); shorter ones are joined in runs of up to CHUNK
ABS_MASK = 0x7FFFFFFF       # every bit but the sign: bits of x & ABS_MASK are bits of |x|
_SIGN = -(1 << 31)          # int32's sign bit: XOR with it turns a signed order into unsigned


def _keys(bits: torch.Tensor, keys: torch.Tensor, scratch: torch.Tensor,
          split_table: torch.Tensor) -> None:
    """keys = each element's key, from the bits of |x| (left as they are). Four passes: every
    pass over memory counts, since the whole job is a few passes and one bincount."""
    torch.bitwise_right_shift(bits, LOW_BITS, out=keys)    # the cell
    torch.index_select(split_table, 0, keys, out=scratch)  # its split point
    torch.ge(bits, scratch, out=scratch)                   # 1 at or above it
    torch.add(scratch, keys, alpha=2, out=keys)            # 2 * cell + that


def _finite_max(bits: torch.Tensor, out: torch.Tensor | None = None) -> int:
    """Largest bits of |x| below inf's (negative if none): bits - inf's, with the sign bit
    flipped, puts every inf/NaN below every finite value; two plain passes, no boolean mask."""
    shifted = torch.sub(bits, INF_BITS, out=out)
    return int(shifted.bitwise_xor_(_SIGN).amax()) + _SIGN + INF_BITS


def _nonzero_min(bits: torch.Tensor, out: torch.Tensor | None = None) -> int:
    """Smallest nonzero bits of |x| (>= inf's if none): bits - 1, with the sign bit flipped,
    puts zeros above everything; NaN and inf stay >= inf's bits, so never below a value."""
    shifted = torch.sub(bits, 1, out=out)
    return int(shifted.bitwise_xor_(_SIGN).amin()) - _SIGN + 1


def _count_alone(x: torch.Tensor, plan: KeyPlan, absolute: bool = False
                 ) -> tuple[torch.Tensor, list[int], list[int]]:
    """How many keys >= each threshold (one column, top threshold first), and the bits of amax
    and of min |x|>0, of one flat tensor."""
    n = x.numel()
    # With one thread a smaller chunk is ~1.4x faster here (its passes run from cache); with
    # more, each pass is shared out, and smaller chunks cost more in threads waiting.
    size = n if x.is_cuda else min(n, CHUNK if torch.get_num_threads() > 1 else CHUNK_ONE_THREAD)
    tables = plan_tensors(plan, x.device)
    with work_buffers(size, x.device) as work:
        key_counts, amax, min_nonzero = _count_chunks(x, work, tables.split_table, absolute)
    # how many keys >= t = n - how many keys < t = n - cumsum[t - 1] (none below key 0)
    below = key_counts.cumsum(0).index_select(0, tables.below_index)
    below[-1] = 0  # threshold 0 (the last row), which every key is at or above
    return (n - below)[:, None], [amax], [min_nonzero]


def _count_chunks(x: torch.Tensor, work: WorkBuffers, split_table: torch.Tensor,
                  absolute: bool = False) -> tuple[torch.Tensor, int, int]:
    """Key counts of x, a buffer-sized chunk at a time, and the bits of amax and min |x|>0.
    absolute: x already holds |x| (as staged by capture), so its bits are used as they are."""
    n, size = x.numel(), work.bits.numel()
    key_counts, amax, min_nonzero = None, -1, INF_BITS
    for start in range(0, n, size):
        chunk = x[start:start + size]
        m = chunk.numel()
        bits, keys, scratch = work.bits[:m], work.keys[:m], work.scratch[:m]
        if absolute:
            bits = chunk.view(torch.int32)
        else:
            torch.bitwise_and(chunk.view(torch.int32), ABS_MASK, out=bits)
        low, high = (int(v) for v in torch.aminmax(bits))
        # Exact extremes cost a masked pass only where zeros or inf/NaN are present.
        amax = max(amax, high if high < INF_BITS else _finite_max(bits, keys))
        min_nonzero = min(min_nonzero, low if low > 0 else _nonzero_min(bits, keys))
        _keys(bits, keys, scratch, split_table)
        counts = _bincount(keys)
        key_counts = counts if key_counts is None else key_counts.add_(counts)
    return key_counts, amax, min_nonzero


# One worker thread per process, made on first use (a forked child gets its own: the
# parent's thread does not exist there).
_BINCOUNT_WORKERS: dict[int, ThreadPoolExecutor] = {}


def _bincount(keys: torch.Tensor) -> torch.Tensor:
    """bincount of keys. torch's CPU bincount is one serial loop: with more than one torch
    thread, half of a large chunk is counted on a second thread meanwhile."""
    if keys.is_cuda or keys.numel() < 1 << 20 or torch.get_num_threads() < 2:
        return torch.bincount(keys, minlength=N_KEYS)
    worker = _BINCOUNT_WORKERS.get(os.getpid())
    if worker is None:
        worker = _BINCOUNT_WORKERS.setdefault(os.getpid(),
                                              ThreadPoolExecutor(1, "ampnb-bincount"))
    half = keys.numel() // 2
    other = worker.submit(torch.bincount, keys[half:], minlength=N_KEYS)
    return torch.bincount(keys[:half], minlength=N_KEYS).add_(other.result())


def _count_joined(parts: Sequence[torch.Tensor], plan: KeyPlan, absolute: bool = False
                  ) -> tuple[torch.Tensor, list[int], list[int]]:
    """The same for each of some short flat tensors (a column each), joined in one buffer:
    keys mapped to classes, counted by (class, segment) in one bincount."""
    n_seg, n_thresholds, device = len(parts), len(plan.thresholds), parts[0].device
    layout = row_layout(tuple(p.numel() for p in parts), device, parts[0].dtype)
    tables = plan_tensors(plan, device)
    with work_buffers(layout.size, device) as work:
        # Each segment starts on a row of ROW elements, zeros after it up to the next row.
        torch.cat([t for pair in zip(parts, layout.pads) for t in pair], out=work.bits_as_float)
        if not absolute:
            work.bits.bitwise_and_(ABS_MASK)
        amax, min_nonzero = _row_extremes(work, layout)
        _keys(work.bits, work.keys, work.scratch, tables.split_table)
        # scratch = (n_seg + 1) * class + segment, for one bincount over (class, segment);
        # padding is segment n_seg, dropped. Class-major, so that picking rows copies rows.
        torch.index_select(tables.classes(n_seg + 1), 0, work.keys, out=work.scratch)
        work.scratch.add_(layout.segment_of_element)
        by_class = torch.bincount(work.scratch, minlength=(n_seg + 1) * n_thresholds)
        by_class = by_class.view(n_thresholds, n_seg + 1)[:, :n_seg]
    return by_class.cumsum(0), amax, min_nonzero


def _row_extremes(work: WorkBuffers, layout: RowLayout) -> tuple[list[int], list[int]]:
    """Per segment the bits of amax and of min |x|>0, from the bits of |x| joined on rows
    (the keys buffer is scratch here): one reduction per row for both, then the rows'
    results by segment. Only a segment holding inf or NaN takes one more pass."""
    bits = work.bits
    # (bits - 1) ^ ABS_MASK = 2**31 - bits for bits > 0 (larger for smaller |x|), int32's
    # min for 0: the largest of it per row is the smallest nonzero |x|, in one amax with bits'.
    torch.sub(bits, 1, out=work.keys).bitwise_xor_(ABS_MASK)
    # (from 0: every bits >= 0, and an all-zero segment's min is then past any value: none)
    highs, flipped_lows = torch.scatter_reduce(layout.no_extremes, 1, layout.segment_of_row,
                                               work.rows.amax(2), "amax").tolist()
    amax = []
    for i, high in enumerate(highs):
        if high >= INF_BITS:
            start = layout.starts[i]
            high = _finite_max(bits[start:start + layout.lengths[i]])
        amax.append(high)
    return amax, [(1 << 31) - low for low in flipped_lows]


class Counts(NamedTuple):
    """What count_segments finds, per segment."""

    table: torch.Tensor     # (segments, head levels + bins): how many |x| >= each of the
    #                         plan's head levels, then the histogram's count in each bin
    shared: Levels          # how many |x| >= each shared level: a list over the segments each
    amax_bits: list[int]    # per segment (none: past inf's bits)
    min_nonzero_bits: list[int]


def _runs(parts: Sequence[torch.Tensor]) -> list[list]:
    """[first, last) indices into parts, and whether counted alone: a long part alone, runs
    of short ones together, up to CHUNK elements each."""
    runs: list[list] = []
    size = 0
    for i, p in enumerate(parts):
        n = p.numel()
        alone = n >= ALONE or len(parts) == 1
        if alone or not runs or runs[-1][2] or size + n + ROW > CHUNK:
            runs.append([i, i + 1, alone])
            size = 0
        else:
            runs[-1][1] = i + 1
        size += n + ROW  # (at most: its padding is less than a row)
    return runs


def count_segments(parts: Sequence[torch.Tensor], plan: KeyPlan, absolute: bool = False
                   ) -> Counts:
    """The counts of each flat float32 tensor of parts."""
    columns, amax, min_nonzero = [], [], []
    for first, last, alone in _runs(parts):
        ge, high, low = _count_alone(parts[first], plan, absolute) if alone else \
            _count_joined(parts[first:last], plan, absolute)
        columns.append(ge)
        amax += high
        min_nonzero += low
    ge = torch.cat(columns, dim=1) if len(columns) > 1 else columns[0]  # threshold x segment
    picks = plan_tensors(plan, ge.device).picks
    # One small transfer: the shared counts, and whether a straggler's cell holds anything.
    summary = ge.index_select(0, picks.summary).tolist()
    # per straggler and segment: how many elements its cell holds at or above its first key
    held = [[ge_first - ge_next for ge_first, ge_next in zip(firsts, nexts)]
            for firsts, nexts in zip(summary[picks.straggler_first], summary[picks.straggler_next])]
    if any(map(any, held)):  # count those elements exactly
        levels = _count_stragglers(parts, plan, ge.index_select(0, picks.level_rows), held)
        table = levels.index_select(0, picks.level_plus) - \
            levels.index_select(0, picks.level_minus)
    else:  # the usual case: every level's count is a threshold's
        table = ge.index_select(0, picks.table_plus) - ge.index_select(0, picks.table_minus)
    return Counts(table.t(), Levels(*summary[picks.shared]), amax, min_nonzero)


def _count_stragglers(parts: Sequence[torch.Tensor], plan: KeyPlan, levels: torch.Tensor,
                      held: list[list[int]]) -> torch.Tensor:
    """levels (how many |x| >= each level of the plan, per segment, from key counts), plus
    one masked pass over a straggler's cell in the segments that have elements there."""
    for straggler, held_by_segment in zip(plan.stragglers, held):
        ix = sorted(straggler.levels, key=lambda i: plan.levels[i])  # levels, ascending
        bounds = torch.tensor([float_bits(plan.levels[i]) for i in ix], dtype=torch.int32,
                              device=levels.device)
        for s in (s for s, n in enumerate(held_by_segment) if n):
            bits = parts[s].view(torch.int32) & ABS_MASK
            inside = bits[(bits >> LOW_BITS) == straggler.cell]
            below = torch.bucketize(inside, bounds, right=True)  # how many bounds are <= bits
            per = torch.bincount(below, minlength=len(ix) + 1)
            levels[ix, s] += per.flip(0).cumsum(0).flip(0)[1:]  # how many bits >= each bound
    return levels
