"""Per block of a tensor: its scale, and the share of its values flushed to zero in a
block-scaled format against FP8 e4m3 scaled per tensor (the data of `plots.plot_block_flush`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ampnb.block_formats import BlockFormat, quantize_blocks
from ampnb.block_formats import get_format as any_format
from ampnb.whatif.casts import get_cast


@dataclass(frozen=True)
class BlockStats:
    """One row per block along the last dim (rows of x one after another)."""

    format: str
    block_size: int
    log2_scale: tuple[float, ...]  # each block's scale exponent (MX: its e8m0 exponent, FLOOR)
    flushed: tuple[float, ...]  # share of the block's nonzero values flushed, block-scaled
    flushed_tensorwise: tuple[float, ...]  # the same values in FP8 e4m3 scaled per tensor
    element_binades: tuple[float, float]  # log2 of the element's smallest subnormal and max


def _per_block(mask: torch.Tensor, nonzero: torch.Tensor, size: int) -> tuple[float, ...]:
    pad = -mask.shape[-1] % size
    m = torch.nn.functional.pad(mask, (0, pad)).reshape(-1, size).sum(-1)
    n = torch.nn.functional.pad(nonzero, (0, pad)).reshape(-1, size).sum(-1)
    return tuple((m.double() / n.clamp(min=1)).tolist())


def block_stats(x: torch.Tensor, fmt: str | BlockFormat = "mxfp8_e4m3") -> BlockStats:
    """Each block's scale and flushed share, beside tensorwise FP8's for the same values."""
    f = any_format(fmt)
    if not isinstance(f, BlockFormat):
        raise ValueError(f"block_stats needs a block-scaled format, got {fmt!r}")
    x2 = x.detach().float().reshape(-1, x.shape[-1] if x.dim() else 1)
    y, _ = quantize_blocks(x2, f)
    t, _ = get_cast("fp8_e4m3_tensorwise")(x2)
    nonzero = x2 != 0
    size = f.block_size
    pad = -x2.shape[-1] % size
    amax = torch.nn.functional.pad(x2.abs(), (0, pad)).reshape(-1, size).amax(-1)
    # OCP MX's scale: 2**(floor(log2 amax) - emax_elem) (NVFP4's e4m3 scale: about this).
    scales = tuple(math.floor(math.log2(a)) - f.element.max_exponent if a > 0 else math.nan
                   for a in amax.tolist())
    return BlockStats(f.name, size, scales,
                      _per_block(nonzero & (y == 0), nonzero, size),
                      _per_block(nonzero & (t == 0), nonzero, size),
                      (math.log2(f.element.smallest_subnormal), math.log2(f.element.max)))
