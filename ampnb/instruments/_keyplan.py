"""Which 16-bit keys a set of formats needs, and where each count is read from their counts.

With `bits` the bits of |x| (float32), an element's cell is bits >> 16 (exponent and 7 mantissa
bits) and its key is 2 * cell + (bits >= the cell's split point). Every cell has one split
point: by default low bits 1 ("any low bit set"), which makes "|x| > a power of two" exact (fp8
and fp16 underflow, e4m3 overflow); where a format rounds inside a cell (fp16's 65520, bf16's
half-ulps) the split is there. A level on neither a cell start nor its cell's split is a
straggler, counted by one masked pass over its cell's elements, and only when that cell holds
any (in practice: float32 subnormals, and values within 0.4 % of float32's max when tf32 and
bf16 are asked together).

Count tables ("how many keys >= each threshold") run from the top threshold down, row 0 being
the one past every key (always 0): keys numbered by class from the top then give every count
with one cumsum.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ampnb.formats import FloatFormat, get_format
from ampnb.instruments._bins import HISTOGRAM_EDGES, SHARED_LEVELS, CutPoints, cut_points

LOW_BITS = 16         # bits of |x| below the cell number
N_CELLS = 1 << 15     # cells of |x|'s 31 bits
N_KEYS = 2 * N_CELLS  # a lower and an upper key per cell


def float_bits(v: float) -> int:
    """The bits of v as a float32."""
    return struct.unpack("<I", struct.pack("<f", v))[0]


def next_cell_key(cell: int) -> int:
    """The first key of the cell after this one: keys >= it are every element above the cell."""
    return 2 * cell + 2


class Straggler(NamedTuple):
    """A cell holding levels on neither its start nor its split: they need a masked pass."""

    cell: int
    levels: tuple[int, ...]  # indices into KeyPlan.levels


@dataclass(frozen=True, eq=False)  # hashed by identity: one per format set (cached)
class KeyPlan:
    """The keys one set of formats needs, and how to read every count from them."""

    levels: tuple[float, ...]            # how many |x| >= v is wanted for each of these
    head_levels: int                     # levels[:head_levels]: the shared levels and the
    #                                      formats' cut points; the histogram's edges follow
    thresholds: tuple[int, ...]          # sorted keys; class i holds keys in [t[i], t[i+1]);
    #                                      the last is past every key: its count is always 0
    level_thresholds: tuple[int, ...]    # per level: its threshold's index (a straggler's:
    #                                      the next cell's; the masked pass adds the rest)
    splits: tuple[tuple[int, int], ...]  # (cell, low bits) where the split is not 1
    stragglers: tuple[Straggler, ...]
    cuts: tuple[CutPoints, ...]          # per format

    def threshold_index(self, key: int) -> int:
        """Index of a key among the thresholds."""
        return self.thresholds.index(key)

    def row(self, threshold_index: int) -> int:
        """Row of a threshold in a count table (top threshold first)."""
        return len(self.thresholds) - 1 - threshold_index


@functools.lru_cache(maxsize=64)
def key_plan(fmts: tuple[FloatFormat, ...]) -> KeyPlan:
    """The KeyPlan for these formats (cached: a training loop asks for the same ones)."""
    work = get_format(torch.float32)
    cuts = tuple(cut_points(f, work) for f in fmts)
    head = tuple(dict.fromkeys((*SHARED_LEVELS, *(c for cs in cuts for c in cs))))
    levels = (*head, *(e for e in HISTOGRAM_EDGES if e not in head))
    split = {0: 1}  # cell 0 splits zeros from the rest, so zeros are always counted exactly
    for v in levels:
        cell, low = divmod(float_bits(v), 1 << LOW_BITS)
        if low:
            split.setdefault(cell, low)  # first come: the formats' own order decides
    keys, strays = [], {}
    for i, v in enumerate(levels):
        cell, low = divmod(float_bits(v), 1 << LOW_BITS)
        if low == 0 or split[cell] == low:
            keys.append(2 * cell + (low != 0))
        else:
            keys.append(next_cell_key(cell))
            strays.setdefault(cell, []).append(i)
    # a straggler's cell needs both its keys and the next cell's, to tell whether it holds any
    cell_keys = (k for c in strays for k in (2 * c, 2 * c + 1, next_cell_key(c)))
    thresholds = sorted({*keys, *cell_keys, N_KEYS})
    index = {k: i for i, k in enumerate(thresholds)}
    return KeyPlan(levels, len(head), tuple(thresholds), tuple(index[k] for k in keys),
                   tuple((cell, low) for cell, low in split.items() if low != 1),
                   tuple(Straggler(cell, tuple(ix)) for cell, ix in strays.items()), cuts)


class Picks(NamedTuple):
    """Rows count_segments picks from a count table (per threshold, top first)."""

    summary: torch.Tensor         # the shared levels' rows, then each straggler's first
    #                               possible key's rows, then its next cell's rows
    shared: slice                 # where each part lies in the summary
    straggler_first: slice
    straggler_next: slice
    level_rows: torch.Tensor      # every level's row, then row 0 (always 0)
    table_plus: torch.Tensor      # output column = count at plus - count at minus:
    table_minus: torch.Tensor     # the head levels, then the histogram's bins
    level_plus: torch.Tensor      # the same, as rows of the level counts picked by level_rows
    level_minus: torch.Tensor


def _first_key(plan: KeyPlan, straggler: Straggler) -> int:
    """The lowest key of a cell that can hold elements at or above one of its stragglers."""
    split = dict(plan.splits).get(straggler.cell, 1)
    low = min(float_bits(plan.levels[i]) & ((1 << LOW_BITS) - 1) for i in straggler.levels)
    return 2 * straggler.cell + (low >= split)  # in cell 0, say, zeros never need the pass


def _picks(plan: KeyPlan, device: torch.device) -> Picks:
    """The rows count_segments picks for this plan, as index tensors on the device."""
    at = {v: i for i, v in enumerate(plan.levels)}
    rows = [plan.row(t) for t in plan.level_thresholds]
    zero = len(plan.levels)  # the row level_rows adds: row 0, always 0
    # a bin's count = how many >= its lower edge - how many >= its upper edge
    edges = [at[SHARED_LEVELS.tiniest], *(at[e] for e in HISTOGRAM_EDGES), at[SHARED_LEVELS.inf]]
    plus = [*range(plan.head_levels), *edges[:-1]]
    minus = [zero] * plan.head_levels + edges[1:]
    shared = [rows[at[v]] for v in SHARED_LEVELS]
    first = [plan.row(plan.threshold_index(_first_key(plan, s))) for s in plan.stragglers]
    after = [plan.row(plan.threshold_index(next_cell_key(s.cell))) for s in plan.stragglers]
    level_rows = [*rows, 0]
    n, k = len(shared), len(plan.stragglers)

    def tensor(v: list[int]) -> torch.Tensor:
        return torch.tensor(v, device=device)

    return Picks(tensor(shared + first + after), slice(0, n), slice(n, n + k),
                 slice(n + k, n + 2 * k), tensor(level_rows),
                 tensor([level_rows[i] for i in plus]), tensor([level_rows[i] for i in minus]),
                 tensor(plus), tensor(minus))


class PlanTensors:
    """A plan's tables on one device, made once (see plan_tensors)."""

    __slots__ = ("split_table", "below_index", "picks", "_class_of_key", "_classes")

    def __init__(self, plan: KeyPlan, device: torch.device) -> None:
        # Each cell's split point as the bits of |x| it starts at (int32, one per cell): one
        # compare of the whole bits then decides the key, with no masking of the low bits.
        split_table = torch.arange(N_CELLS, dtype=torch.int32) * (1 << LOW_BITS) + 1
        for cell, low in plan.splits:
            split_table[cell] = (cell << LOW_BITS) + low
        self.split_table = split_table.to(device)
        # Per threshold, in row order, the index of the cumulative key count just below it.
        self.below_index = torch.tensor([max(t - 1, 0) for t in reversed(plan.thresholds)],
                                        device=device)
        self.picks = _picks(plan, device)
        # Each key's class, numbered from the top threshold down, as count tables run.
        keys = torch.arange(N_KEYS, dtype=torch.int32)
        thresholds = torch.tensor(plan.thresholds, dtype=torch.int32)
        below = torch.bucketize(keys, thresholds, right=True, out_int32=True) - 1
        self._class_of_key = len(plan.thresholds) - 1 - below
        self._classes: dict[int, torch.Tensor] = {}

    def classes(self, width: int) -> torch.Tensor:
        """Each key's class times width (segments + 1), for one bincount over (class, segment)."""
        table = self._classes.get(width)
        if table is None:
            if len(self._classes) >= 16:  # a few run sizes recur in a training loop
                self._classes.clear()
            table = self._classes[width] = (self._class_of_key * width).to(
                self.split_table.device)
        return table


@functools.lru_cache(maxsize=16)
def plan_tensors(plan: KeyPlan, device: torch.device) -> PlanTensors:
    """The device tables of a plan: the one cache of them, per plan and device."""
    return PlanTensors(plan, device)
