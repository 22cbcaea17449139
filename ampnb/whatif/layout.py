"""Many tensors as one buffer of 32-value blocks, so that each cast runs once over all of them.

Each tensor's rows (its last axis: the axis block-scaled formats block along) are zero-padded
to a multiple of 32 and laid end to end. Zeros change no block's amax, round to zero in every
format and add nothing to an error, so a tensor's figures are the sums over its own blocks; a
row of 40 makes a block of 32 and one of 8 plus 24 zeros, as `quantize_blocks` pads it. NVFP4's
blocks of 16 are the halves of these blocks. Each tensor then takes whole lines of `LINE`
values (zeros after its last row): the statistics are summed per line, where a CPU sums 1,024
values in half the time it sums 32 values 32 times, and a line belongs to one tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ampnb.fp8.scaling import tensor_to_amax

BLOCK = 32
LINE = 32 * BLOCK  # values summed at once by the statistics (a multiple of BLOCK)


@dataclass(frozen=True)
class Whole:
    """A tensor split across flushes: its amax and the amax of its finite values, taken whole."""

    amax: torch.Tensor
    finite_amax: torch.Tensor


@dataclass(frozen=True)
class Blocks:
    """The pending tensors as (blocks, 32), with what every cast shares: amaxes, scratch."""

    x: torch.Tensor  # (nb, 32) fp32
    amax16: torch.Tensor  # (nb, 2, 1): each half block's largest magnitude (NaN if it holds one)
    amax32: torch.Tensor  # (nb, 1)
    tensor_blocks: torch.Tensor  # (T,) how many blocks each tensor has (its lines' blocks)
    tensor_lines: torch.Tensor  # (T,) how many lines each tensor has
    tensor_amax: torch.Tensor  # (T,) each tensor's amax (of the whole tensor, when split)
    top: float  # the largest of them (NaN if any is): one sync, shared by the casts
    starts: tuple[int, ...]  # each tensor's first line
    shapes: tuple[tuple[torch.Size, int], ...]  # each tensor's shape and padded row length
    whole: tuple[Whole | None, ...]
    pair: torch.Tensor  # (2, nb, 32): work and out in one memory, summed per line in one call

    @property
    def work(self) -> torch.Tensor:
        """(nb, 32) fp32 scratch (also read as int32)."""
        return self.pair[0]

    @property
    def out(self) -> torch.Tensor:
        """(nb, 32) fp32: where the casts write."""
        return self.pair[1]

    @property
    def finite(self) -> bool:
        """Whether no tensor holds an inf or a NaN."""
        return math.isfinite(self.top)

    def per_block(self, v: torch.Tensor) -> torch.Tensor:
        """One value per tensor (T,) repeated for each of its blocks (nb,)."""
        return torch.repeat_interleave(v, self.tensor_blocks, output_size=self.x.shape[0])

    def per_line(self, v: torch.Tensor) -> torch.Tensor:
        """One value per tensor (T,) repeated for each of its lines."""
        return torch.repeat_interleave(v, self.tensor_lines, output_size=self.x.shape[0] * BLOCK // LINE)

    def line_sums(self, mask: torch.Tensor) -> torch.Tensor:
        """Per line, the sum of a float tensor shaped as the blocks (a count, for a 0/1 mask)."""
        return mask.view(-1, LINE).sum(1)

    def row_blocks(self) -> torch.Tensor:
        """(R,) blocks per row, rows in order (a tensor's zeros after its rows: one more row)."""
        per_row, rows = [], []
        for s, p in self.shapes:
            n = s.numel() // s[-1]
            tail = _lines(s, p) * (LINE // BLOCK) - n * p // BLOCK
            per_row += [p // BLOCK] + ([tail] if tail else [])
            rows += [n] + ([1] if tail else [])
        return torch.repeat_interleave(torch.tensor(per_row, device=self.x.device),
                                       torch.tensor(rows, device=self.x.device), output_size=sum(rows))

    def scratch(self, *shape: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The scratch shaped as the blocks (`shape`), read as float32 and as int32 (one memory)."""
        return self.work.view(*shape), self.work.view(torch.int32).view(*shape)

    def finite_amax(self, t: int) -> torch.Tensor:
        """The amax of tensor t's finite values (for NVFP4's tensor scale)."""
        if self.whole[t] is not None:
            return self.whole[t].finite_amax
        return self.of_tensor(t).abs().nan_to_num(0.0, 0.0, 0.0).amax()

    def padding(self, q: torch.Tensor) -> list[torch.Tensor]:
        """The padding in q (shaped as x) of each tensor whose amax is inf or NaN: the one case
        where a cast turns a padded zero into something else (0 * NaN, 0 / 0)."""
        if self.finite:
            return []
        bad = (~torch.isfinite(self.tensor_amax)).nonzero().flatten().tolist()
        flat, out = q.reshape(-1), []
        for t in bad:
            (s, p), start = self.shapes[t], LINE * self.starts[t]
            used, lines = s[:-1].numel() * p, _lines(s, p)
            if p > s[-1]:  # zeros at the end of each row
                out.append(flat[start:start + used].view(*s[:-1], p)[..., s[-1]:])
            if lines * LINE > used:  # zeros after the last row
                out.append(flat[start + used:start + lines * LINE])
        return out

    def of_tensor(self, t: int) -> torch.Tensor:
        """Tensor t's blocks."""
        per = LINE // BLOCK
        end = self.starts[t + 1] * per if t + 1 < len(self.starts) else self.x.shape[0]
        return self.x[self.starts[t] * per:end]


def _block_amax(x: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """(n, 32) values -> (n, 2, 1): each half block's largest magnitude, NaN where it holds one.
    |x| is taken into `scratch` and reduced as int32: the bits of a non-negative float order as
    its value (a NaN, its sign cleared by abs, above inf), and an integer max along a short axis
    costs a CPU half of what a tree of float maxima does."""
    a = torch.abs(x, out=scratch).view(torch.int32).view(-1, BLOCK // 2)
    return a.amax(-1).view(torch.float32).view(-1, 2, 1)


def whole(x: torch.Tensor) -> Whole:
    """x's amax and its finite values' amax (NaN-propagating, as a block amax is)."""
    amax = tensor_to_amax(x)  # no |x| temporary; NaN if x holds one
    finite = amax if bool(torch.isfinite(amax)) else x.abs().nan_to_num(0.0, 0.0, 0.0).amax()
    return Whole(amax, finite)


class Pending:
    """Tensors copied into one zero-padded buffer as they come (nothing of the caller's kept);
    `blocks()` adds the two scratch copies a flush rounds in."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(-(-capacity // LINE) * LINE, LINE)
        self.data = None
        self.used = 0
        self.shapes: list[tuple[torch.Size, int]] = []  # each tensor's shape, padded row length
        self.whole: list[Whole | None] = []

    def room(self, x: torch.Tensor) -> int:
        """How many slices of x along its first axis fit in the buffer (a tensor of fewer than
        two axes is one slice); x.shape[0] at most, 0 when none does."""
        if self.shapes and self.data.device != x.device:
            return 0
        units = x.shape[0] if x.dim() > 1 else 1
        # (used and capacity are whole lines: k units that fit take whole lines that fit)
        return min(units, (self.capacity - self.used) // max(_padded(x, lines=False) // units, 1))

    def put(self, x: torch.Tensor, taken_whole: Whole | None = None) -> None:
        """Copy x (fp32, rows on its last axis) into the buffer, its rows zero-padded."""
        n = _padded(x)
        if self.data is None or self.data.device != x.device or self.used + n > self.data.numel():
            self._grow(x.device, n)
        shape = x.shape if x.dim() else torch.Size((1,))
        length = shape[-1]
        padded = -(-length // BLOCK) * BLOCK
        rows = _padded(x, lines=False)
        dst = self.data[self.used:self.used + rows].view(*shape[:-1], padded)
        dst[..., :length].copy_(x.reshape(shape))
        if padded > length:
            dst[..., length:].zero_()
        if n > rows:
            self.data[self.used + rows:self.used + n].zero_()
        self.shapes.append((shape, padded))
        self.whole.append(taken_whole)
        self.used += n

    def _grow(self, device: torch.device, n: int) -> None:
        """Room for n more elements: up to the capacity (or n alone), doubling, data kept."""
        old = self.data if self.shapes else None
        size = max(min(self.capacity, 2 * self.used + n), self.used + n)
        self.data = torch.empty(size, device=device)
        if old is not None:
            self.data[:self.used].copy_(old[:self.used])

    def blocks(self) -> Blocks:
        """The buffer as blocks, with each block's, row's and tensor's amax."""
        nb = self.used // BLOCK
        x = self.data[:self.used].view(nb, BLOCK)
        # The scratch lives for one flush only: between flushes, while the model's own tensors
        # come and go, the buffer alone is held (a third of the memory).
        pair = torch.empty(2, nb, BLOCK, device=x.device)
        amax16 = _block_amax(x, pair[0])
        amax32 = torch.maximum(amax16[:, 0], amax16[:, 1])
        lines = [_lines(s, p) for s, p in self.shapes]
        tensor_lines = torch.tensor(lines, device=x.device)
        tensor_blocks = tensor_lines * (LINE // BLOCK)
        tensor_amax = torch.segment_reduce(amax32.view(-1), "max", lengths=tensor_blocks, unsafe=True)
        for t, w in enumerate(self.whole):
            if w is not None:  # split: the amax of the whole tensor, not of this piece
                tensor_amax[t] = w.amax
        starts = [0]
        for c in lines[:-1]:
            starts.append(starts[-1] + c)
        return Blocks(x, amax16, amax32, tensor_blocks, tensor_lines, tensor_amax,
                      float(tensor_amax.max()), tuple(starts), tuple(self.shapes), tuple(self.whole),
                      pair)

    def unpad(self, flat: torch.Tensor) -> torch.Tensor:
        """The one tensor in the buffer, taken back out of `flat` (a buffer-shaped result)."""
        (shape, padded), = self.shapes
        return flat.reshape(-1)[:shape[:-1].numel() * padded].view(*shape[:-1], padded)[..., :shape[-1]]

    def clear(self) -> None:
        self.used, self.shapes, self.whole = 0, [], []


def _lines(shape: torch.Size, padded: int) -> int:
    """How many lines a tensor of this shape takes, its rows padded to `padded`."""
    return -(-(shape.numel() // shape[-1] * padded) // LINE)


def _padded(x: torch.Tensor, lines: bool = True) -> int:
    """x's size in the buffer: its rows zero-padded to a multiple of 32, then to whole lines
    (`lines=False`: the rows alone)."""
    length = x.shape[-1] if x.dim() else 1
    rows = x.numel() // max(length, 1) * (-(-length // BLOCK) * BLOCK)
    return -(-rows // LINE) * LINE if lines else rows
