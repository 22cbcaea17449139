"""Many tensors as one buffer of 32-value blocks, so that each cast runs once over all of them.

Each tensor's rows (its last axis: the axis block-scaled formats block along) are zero-padded
to a multiple of 32 and laid end to end. Zeros change no block's amax, round to zero in every
format and add nothing to an error, so a tensor's figures are the sums over its own blocks; a
row of 40 makes a block of 32 and one of 8 plus 24 zeros, as `quantize_blocks` pads it. NVFP4's
blocks of 16 are the halves of these blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32


@dataclass(frozen=True)
class Blocks:
    """The pending tensors as (blocks, 32), with what every cast shares: amaxes, scratch."""

    x: torch.Tensor  # (nb, 32) fp32
    amax16: torch.Tensor  # (2 nb, 1): each half block's largest magnitude (NaN if it holds one)
    amax32: torch.Tensor  # (nb, 1)
    tensor: torch.Tensor  # (nb,) which tensor each block belongs to
    tensor_blocks: torch.Tensor  # (T,) blocks per tensor
    row_blocks: torch.Tensor  # (R,) blocks per row, rows in order
    tensor_amax: torch.Tensor  # (T,)
    starts: tuple[int, ...]  # each tensor's first block
    work: torch.Tensor  # (nb, 32) fp32 scratch (also read as int32)
    shapes: tuple[tuple[torch.Size, int], ...]  # each tensor's shape and padded row length

    def scratch(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The scratch as (-1, size) blocks, read as float32 and as int32 (one memory)."""
        return self.work.view(-1, size), self.work.view(torch.int32).view(-1, size)

    def padding(self, q: torch.Tensor) -> list[torch.Tensor]:
        """The padding in q (shaped as x) of each tensor whose amax is inf or NaN: the one case
        where a cast turns a padded zero into something else (0 * NaN, 0 / 0)."""
        ragged = [t for t, (s, p) in enumerate(self.shapes) if p > s[-1]]
        if not ragged or bool(torch.isfinite(self.tensor_amax).all()):
            return []
        bad = set((~torch.isfinite(self.tensor_amax)).nonzero().flatten().tolist())
        flat = q.reshape(-1)
        return [flat[BLOCK * self.starts[t]:].narrow(0, 0, self.shapes[t][0][:-1].numel() * p)
                .view(*s[:-1], p)[..., s[-1]:] for t in ragged if t in bad
                for s, p in (self.shapes[t],)]

    def of_tensor(self, t: int) -> torch.Tensor:
        """Tensor t's blocks."""
        end = self.starts[t + 1] if t + 1 < len(self.starts) else self.x.shape[0]
        return self.x[self.starts[t]:end]


def _block_amax(a: torch.Tensor) -> torch.Tensor:
    """(n, 16) magnitudes -> (n, 1) maxima, as a tree of elementwise maxima: a reduction along
    a short last axis costs several times more on a CPU. torch.maximum keeps NaN, as amax does."""
    width = a.shape[-1] // 2
    while width:
        a = torch.maximum(a[:, :width], a[:, width:2 * width])
        width //= 2
    return a


class Pending:
    """Tensors copied into one zero-padded buffer as they come (nothing of the caller's kept)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(-(-capacity // BLOCK) * BLOCK, BLOCK)
        self.data = self.work = None
        self.used = 0
        self.shapes: list[tuple[torch.Size, int]] = []  # each tensor's shape, padded row length

    def fits(self, x: torch.Tensor) -> bool:
        """Whether x joins the buffer without a flush (always, when the buffer is empty)."""
        same = self.data is None or self.data.device == x.device
        return not self.shapes or (same and self.used + _padded(x) <= self.capacity)

    def put(self, x: torch.Tensor) -> None:
        """Copy x (fp32, rows on its last axis) into the buffer, its rows zero-padded."""
        n = _padded(x)
        if self.data is None or self.data.device != x.device or self.used + n > self.data.numel():
            self._grow(x.device, n)
        shape = x.shape if x.dim() else torch.Size((1,))
        length = shape[-1]
        padded = -(-length // BLOCK) * BLOCK
        dst = self.data[self.used:self.used + n].view(*shape[:-1], padded)
        dst[..., :length].copy_(x.reshape(shape))
        if padded > length:
            dst[..., length:].zero_()
        self.shapes.append((shape, padded))
        self.used += n

    def _grow(self, device: torch.device, n: int) -> None:
        """Room for n more elements: up to the capacity (or n alone), doubling, data kept."""
        old = self.data if self.shapes else None
        size = max(min(self.capacity, 2 * self.used + n), self.used + n)
        self.data = torch.empty(size, device=device)
        self.work = torch.empty(size, device=device)
        if old is not None:
            self.data[:self.used].copy_(old[:self.used])

    def blocks(self) -> Blocks:
        """The buffer as blocks, with each block's, row's and tensor's amax."""
        nb, dev = self.used // BLOCK, self.data.device
        x = self.data[:self.used].view(nb, BLOCK)
        work = self.work[:self.used].view(nb, BLOCK)
        amax16 = _block_amax(torch.abs(x, out=work).view(2 * nb, BLOCK // 2))
        amax32 = torch.maximum(amax16[0::2], amax16[1::2])
        per_row = [p // BLOCK for _, p in self.shapes]
        rows = [s.numel() // s[-1] for s, _ in self.shapes]
        counts = [r * p for r, p in zip(rows, per_row)]
        tensor_blocks = torch.tensor(counts, device=dev)
        starts = [0]
        for c in counts[:-1]:
            starts.append(starts[-1] + c)
        return Blocks(
            x, amax16, amax32,
            torch.repeat_interleave(torch.arange(len(counts), device=dev), tensor_blocks),
            tensor_blocks,
            torch.repeat_interleave(torch.tensor(per_row, device=dev), torch.tensor(rows, device=dev)),
            torch.segment_reduce(amax32.view(-1), "max", lengths=tensor_blocks), tuple(starts), work,
            tuple(self.shapes))

    def unpad(self, flat: torch.Tensor) -> torch.Tensor:
        """The one tensor in the buffer, taken back out of `flat` (a buffer-shaped result)."""
        (shape, padded), = self.shapes
        return flat.reshape(-1)[:self.used].view(*shape[:-1], padded)[..., :shape[-1]]

    def clear(self) -> None:
        self.used, self.shapes = 0, []


def _padded(x: torch.Tensor) -> int:
    """x's size in the buffer: its rows zero-padded to a multiple of 32."""
    length = x.shape[-1] if x.dim() else 1
    return x.numel() // max(length, 1) * (-(-length // BLOCK) * BLOCK)
