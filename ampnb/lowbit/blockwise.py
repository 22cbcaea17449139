"""bitsandbytes' dynamic 8-bit map and its block-wise quantization (8-bit optimizer state, nf4-dq scales)."""

from __future__ import annotations

from functools import cache

import torch


@cache
def dynamic_map(signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8) -> torch.Tensor:
    """bitsandbytes' `create_dynamic_map`: 256 sorted values in [-1, 1] (or [0, 1] unsigned).

    Dettmers' dynamic type: a run of zeros ends in an indicator bit, the zeros are a decimal
    exponent (1e0 .. 1e-6) and the bits after the indicator a linear fraction in (0.1, 1), so
    small magnitudes keep relative precision. The arithmetic (float32 `linspace`, means times a
    Python power of ten) follows bitsandbytes/functional.py so the values match bit for bit.
    """
    non_sign_bits = total_bits - 1
    data: list[float] = []
    for i in range(max_exponent_bits):
        items = 2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed \
            else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1
        bounds = torch.linspace(0.1, 1, items, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    extra = 2 ** (non_sign_bits - max_exponent_bits) - 1  # all-zero exponent, no indicator bit
    if extra > 0:
        bounds = torch.linspace(0.1, 1, extra + 1, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    data += [0.0, 1.0]
    data += [0.0] * (256 - len(data))
    return torch.tensor(sorted(data), dtype=torch.float32)


def nearest_index(x: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """argmin_i |x - code[i]| per element, the first index on ties (bitsandbytes' reference rule).

    Memory stays O(x): the nearest value is one of the two sorted code values around x's
    insertion point, so a 256-value map costs no more than a 16-value one.
    """
    order = torch.argsort(code, stable=True)
    s = code[order]
    # Equal code values (fp4's +0 and -0) answer with the first index, as argmin does.
    at = torch.searchsorted(s, s)
    first = torch.full((s.numel(),), s.numel(), dtype=torch.long, device=code.device)
    canon = first.scatter_reduce(0, at, order, "amin")[at]
    pos = torch.searchsorted(s, x.contiguous()).clamp_(1, s.numel() - 1)
    lo, hi = canon[pos - 1], canon[pos]
    d_lo, d_hi = (x - s[pos - 1]).abs(), (x - s[pos]).abs()
    return torch.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi < lo)), hi, lo)


def absmax_scale(flat: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(absmax per block, values scaled into [-1, 1]) as bitsandbytes computes them: x * (1/absmax)."""
    n = flat.numel()
    pad = (-n) % blocksize
    blocks = torch.cat([flat.float(), flat.new_zeros(pad, dtype=torch.float32)]).reshape(-1, blocksize)
    absmax = blocks.abs().amax(dim=1)
    scaled = torch.clamp(blocks * (1.0 / absmax.clamp(min=1e-38))[:, None], -1, 1)
    return absmax, scaled.reshape(-1)[:n]


def check_blocksize(blocksize: int) -> int:
    """blocksize, or ValueError naming it and what is allowed."""
    if isinstance(blocksize, bool) or not isinstance(blocksize, int) or blocksize < 1:
        raise ValueError(f"blocksize={blocksize!r} is not allowed; allowed: a positive integer "
                         "(bitsandbytes uses 256 for optimizer state, 64 for 4-bit weights)")
    return blocksize


def quantize_blockwise(x: torch.Tensor, code: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bitsandbytes' `quantize_blockwise`: (uint8 index into `code`, fp32 absmax per block)."""
    check_blocksize(blocksize)
    absmax, scaled = absmax_scale(x.reshape(-1), blocksize)
    return nearest_index(scaled, code.to(x.device)).to(torch.uint8).reshape(x.shape), absmax


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """bitsandbytes' `dequantize_blockwise`: code value times its block's absmax, in fp32, then dtype."""
    check_blocksize(blocksize)
    values = code.to(codes.device)[codes.reshape(-1).long()]
    pad = (-values.numel()) % blocksize
    out = torch.cat([values, values.new_zeros(pad)]).reshape(-1, blocksize) * absmax[:, None]
    return out.reshape(-1)[: codes.numel()].reshape(codes.shape).to(dtype)
