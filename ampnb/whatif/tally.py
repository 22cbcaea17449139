"""Running sums per (module, tensor), computed for many tensors at once: the tensors wait in one
zero-padded buffer (`layout.Pending`) and every format rounds the whole buffer in one go."""

from __future__ import annotations

import torch

from ampnb.whatif.casts import Cast
from ampnb.whatif.layout import LINE, Blocks, Pending, Whole, whole
from ampnb.whatif.result import WhatIfRow, sqnr_db

Key = tuple[str, str]


def block_figures(b: Blocks, casts: tuple[Cast, ...], sums: torch.Tensor) -> list[list[float]]:
    """Per tensor [|x|^2, zeros, then per format |x - q(x)|^2, zeros, past max] (float64 sums).

    Each line's sums are taken in fp32 (a row sum per line) into `sums` (2 + 3 F rows, one
    column per line), then each tensor's. The casts write into b.out and use b.work as scratch;
    the two statistics of a pass are written into work and out and summed in one call.
    """
    x, w, out = b.x, b.work, b.out
    zero = x.new_zeros(())  # a 0-dim tensor: no scalar wrapped per call
    rows = sums.unbind(0)
    pair = b.pair.view(2, -1, LINE)  # (work, out) as lines
    xl, wl, ol = x.view(-1, LINE), w.view(-1, LINE), out.view(-1, LINE)
    torch.mul(xl, xl, out=wl)
    torch.eq(xl, zero, out=ol)
    torch.sum(pair, 2, out=sums[0:2])
    none = []  # formats with no value past the max: their count row is left unwritten
    for i, c in enumerate(casts):
        over = c.fn(b, out)
        for pad in b.padding(out):
            pad.zero_()
        # (q - x)^2 in one pass (bit for bit (q - x).square()); then q is no longer needed:
        # every cast keeps a zero a zero (a NaN block aside), so flushed = zeros gained.
        torch.ops.aten.mse_loss.out(ol, xl, 0, out=wl)
        torch.eq(ol, zero, out=ol)
        torch.sum(pair, 2, out=sums[2 + 3 * i:4 + 3 * i])
        if over is None:
            none.append(4 + 3 * i)
        else:
            rows[4 + 3 * i].copy_(over)
    # The lines' fp32 sums added up per tensor in float64 (counts exact), in one call.
    per_tensor = torch.segment_reduce(sums.t().to(torch.float64, memory_format=torch.contiguous_format),
                                      "sum", lengths=b.tensor_lines, unsafe=True).tolist()
    for row in per_tensor:
        for k in none:
            row[k] = 0.0
    return per_tensor


class Tally:
    """Per (module, tensor): per format |x - q(x)|^2, flushed, past max; |x|^2, count.

    Tensors are copied into a buffer of about `bound` elements as they come and rounded when it
    is full and at the end (`flush`): the memory added is the buffer and its scratch, whatever
    the model; no tensor of the caller's is kept.
    """

    def __init__(self, casts: tuple[Cast, ...], bound: int) -> None:
        self.casts = casts
        self.pending = Pending(bound)
        self.keys: list[tuple[Key, int]] = []
        self.sums: dict[Key, tuple[list[float], int] | None] = {}

    def add(self, module: str, tensor: str, x: torch.Tensor) -> None:
        """Queue x (fp32, rows on its last axis) for rounding into every format."""
        key = (module, tensor)
        self.sums.setdefault(key, None)  # rows come in the order the tensors first came
        if x.numel() == 0:
            self._add(key, [0.0] * (2 + 3 * len(self.casts)), 0)
            return
        taken: Whole | None = None
        rest: torch.Tensor | None = x
        while rest is not None:
            x = rest
            k = self.pending.room(x)
            if not k and self.pending.shapes:
                self.flush()
                continue
            k = max(k, 1)  # alone in the buffer: one slice at least, the buffer grows for it
            if x.dim() > 1 and k < x.shape[0]:
                # Split across flushes (along the first axis: whole rows): the tensor's own amax
                # scales tensorwise FP8 and NVFP4, taken before its first piece is rounded.
                taken = taken or whole(x)
                piece, rest = x[:k], x[k:]
            else:
                piece, rest = x, None
            self.pending.put(piece, taken)
            self.keys.append((key, piece.numel()))

    def flush(self) -> None:
        """Round every queued tensor into every format and add up their statistics."""
        if not self.keys:
            return
        b = self.pending.blocks()
        # Not kept between flushes (it would add to the peak memory); every row gets written.
        sums = torch.empty(2 + 3 * len(self.casts), b.x.numel() // LINE, device=b.x.device)
        for (key, n), row in zip(self.keys, block_figures(b, self.casts, sums)):
            self._add(key, row, n)
        self.pending.clear()
        self.keys = []

    def _add(self, key: Key, row: list[float], n: int) -> None:
        old = self.sums[key]  # float64 sums, as Python floats
        self.sums[key] = (row, n) if old is None else ([a + v for a, v in zip(old[0], row)], old[1] + n)

    def rows(self) -> tuple[WhatIfRow, ...]:
        out = []
        for (module, tensor), (row, n) in self.sums.items():  # type: ignore[misc]
            signal, zeros, *per_format = row
            for k, c in enumerate(self.casts):
                noise, zeros_q, over = per_format[3 * k:3 * k + 3]
                out.append(WhatIfRow(module, tensor, c.name, sqnr_db(signal, noise),
                                     (zeros_q - zeros) / max(n, 1), over / max(n, 1), n))
        return tuple(out)
