"""Where the bit-key passes work: int32 work buffers, and short segments joined on rows.

Both are kept between calls, since a training loop counts the same sizes at every step:
on CPU the work memory itself (touching fresh memory costs more there than the passes) and its
buffers per size (making views costs a few torch calls each time, and those add up on a small
model); the row layout of each run of short segments, per lengths (making one costs more than
using it).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
from collections.abc import Iterator
from typing import NamedTuple

import torch

ROW = 64  # elements: short segments are joined on rows of this many, so rows reduce together
KEEP_AT_MOST = 1 << 22      # elements: CPU work memory up to this size is kept between calls
CACHE_LAYOUTS_UP_TO = 1 << 20  # elements: layouts of runs up to this long are cached


class WorkBuffers(NamedTuple):
    """Three int32 work buffers of n elements, and views of them that the passes need."""

    bits: torch.Tensor           # bits of |x|
    keys: torch.Tensor           # each element's key (before that: scratch for the extremes)
    scratch: torch.Tensor        # split points, then (class, segment) numbers
    rows: torch.Tensor | None    # bits and keys as (2, n // ROW, ROW), when n is whole rows
    bits_as_float: torch.Tensor  # bits' memory as float32, where |x| is written


def _work_buffers_in(memory: torch.Tensor, n: int) -> WorkBuffers:
    """The work buffers of n elements at the start of memory (3 * n int32 or more)."""
    three = memory[:3 * n].view(3, n)
    bits, keys, scratch = three.unbind()
    rows = three[:2].view(2, -1, ROW) if n % ROW == 0 else None
    return WorkBuffers(bits, keys, scratch, rows, bits.view(torch.float32))


class _KeptMemory:
    """The CPU work memory kept between calls, and its buffers per size."""

    def __init__(self) -> None:
        self.memory: torch.Tensor | None = None
        self.buffers: dict[int, WorkBuffers] = {}
        self.lock = threading.Lock()  # one user at a time; another thread gets fresh memory

    def buffers_of(self, n: int) -> WorkBuffers:
        """Buffers of n elements in the kept memory (grown when too small)."""
        work = self.buffers.get(n)
        if work is None:
            if self.memory is None or self.memory.numel() < 3 * n:
                self.memory = torch.empty(3 * n, dtype=torch.int32)
                self.buffers.clear()  # views of the old memory
            elif len(self.buffers) >= 16:
                self.buffers.clear()
            work = self.buffers[n] = _work_buffers_in(self.memory, n)
        return work


_KEPT = _KeptMemory()


@contextlib.contextmanager
def work_buffers(n: int, device: torch.device) -> Iterator[WorkBuffers]:
    """Work buffers of n elements: the kept memory on CPU up to KEEP_AT_MOST, else fresh."""
    if device.type != "cpu" or n > KEEP_AT_MOST or not _KEPT.lock.acquire(blocking=False):
        yield _work_buffers_in(torch.empty(3 * n, dtype=torch.int32, device=device), n)
        return
    try:
        yield _KEPT.buffers_of(n)
    finally:
        _KEPT.lock.release()


class RowLayout(NamedTuple):
    """Where each of some short segments lies once joined on rows of ROW elements."""

    size: int                         # elements, padding included
    lengths: tuple[int, ...]
    starts: tuple[int, ...]
    pads: tuple[torch.Tensor, ...]    # zeros that fill each segment's last row
    segment_of_element: torch.Tensor  # int32, per element: its segment (padding: segments)
    segment_of_row: torch.Tensor      # int64 (2, size // ROW): each row's segment, twice
    no_extremes: torch.Tensor         # int32 zeros (2, segments): where row results reduce


def row_layout(lengths: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> RowLayout:
    """The RowLayout of segments of these lengths, cached for runs up to CACHE_LAYOUTS_UP_TO."""
    make = _cached_row_layout if sum(lengths) <= CACHE_LAYOUTS_UP_TO else _make_row_layout
    return make(lengths, device, dtype)


def _make_row_layout(lengths: tuple[int, ...], device: torch.device, dtype: torch.dtype
                     ) -> RowLayout:
    """The RowLayout of segments of these lengths, made anew."""
    rows = [-(-n // ROW) for n in lengths]
    pads = [r * ROW - n for n, r in zip(lengths, rows)]
    n_seg, zeros = len(lengths), torch.zeros(ROW, dtype=dtype, device=device)
    ids = torch.arange(n_seg, dtype=torch.int32, device=device)
    spans = torch.tensor([c for n, p in zip(lengths, pads) for c in (n, p)], device=device)
    segment_of_element = torch.repeat_interleave(
        torch.stack([ids, torch.full_like(ids, n_seg)], 1).ravel(), spans,
        output_size=sum(lengths) + sum(pads))
    segment_of_row = torch.repeat_interleave(ids.long(), torch.tensor(rows, device=device),
                                             output_size=sum(rows))
    starts = tuple(ROW * r for r in itertools.accumulate([0, *rows[:-1]]))
    return RowLayout(ROW * sum(rows), lengths, starts, tuple(zeros[:p] for p in pads),
                     segment_of_element, segment_of_row.expand(2, -1),
                     torch.zeros(2, n_seg, dtype=torch.int32, device=device))


_cached_row_layout = functools.lru_cache(maxsize=4)(_make_row_layout)
