"""The casts a what-if compares: plain float casts, FP8 scaled per tensor or per row, block-scaled.

Each cast rounds every tensor of a `layout.Blocks` at once: it writes the values quantized (in
fp32) into `out` and returns, per line, how many values overflowed or saturated (None: none
did). FP8 tensorwise and rowwise scale to amax as torchao's float8 does (`amax_to_scale`:
max / amax, amax clamped at 1e-12; its rowwise recipe rounds each row's scale down to a power
of two); block-scaled formats are `ampnb.quantize`'s casts (`block_formats.cast_blocks`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ampnb import formats
from ampnb.block_formats import BLOCK_FORMATS, cast_blocks, nvfp4_scale_of, round_elements
from ampnb.formats import FloatFormat
from ampnb.fp8.scaling import EPS, amax_to_scale
from ampnb.whatif.layout import LINE, Blocks, Pending

CastFn = Callable[[Blocks, torch.Tensor], "torch.Tensor | None"]
DEFAULT_FORMATS = ("fp16", "bf16", "fp8_e4m3_tensorwise", "fp8_e4m3_rowwise", "mxfp8_e4m3",
                   "mxfp4", "nvfp4")
_SCALED = ("fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class Cast:
    """A named way to store a tensor: its label and the function that rounds into it."""

    name: str
    fn: CastFn

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x quantized, in fp32; how many values overflowed or saturated)."""
        x = x.detach().float()
        one = Pending(x.numel())
        one.put(x)
        b = one.blocks()
        over = self.fn(b, b.out)
        total = over.sum().long() if over is not None else x.new_zeros((), dtype=torch.int64)
        return one.unpad(b.out).reshape(x.shape), total


def _past_max(b: Blocks, scaled: torch.Tensor, f: FloatFormat) -> torch.Tensor:
    """Per line, how many finite values round past f's max (to inf, or clamped)."""
    a = torch.abs(scaled, out=b.work)
    over = a >= f.overflow_threshold if f.overflow_inclusive else a > f.overflow_threshold
    return over.logical_and_(a != torch.inf).view(-1, LINE).sum(-1)


def _plain(f: FloatFormat) -> CastFn:
    def cast(b: Blocks, out: torch.Tensor) -> torch.Tensor | None:
        if f.torch_dtype is not None and f.torch_dtype.itemsize < 4:  # via the scratch: no copy
            out.copy_(b.work.view(f.torch_dtype)[:, :b.x.shape[1]].copy_(b.x))
        else:
            out.copy_(b.x.to(f.torch_dtype) if f.torch_dtype is not None else formats.quantize(b.x, f))
        # No value of a tensor whose amax is below the threshold can round past f's max.
        return None if b.top < f.overflow_threshold else _past_max(b, b.x, f)
    return cast


def _scaled(f: FloatFormat, scale: torch.Tensor, b: Blocks, out: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x * scale (one per block), saturated into f, divided back. Scaled to amax, a finite
    tensor never overflows: its amax lands on f's max, within a rounding of it, so far below
    the midpoint above max that rounding gives max itself, as the clamp would (no clamp then)."""
    scaled = torch.mul(b.x, scale, out=out)
    over = None
    if not b.finite:
        over = _past_max(b, scaled, f) * b.per_line(~torch.isfinite(b.tensor_amax))
        scaled.clamp_(-f.max, f.max)
    # Finite: no -0 kept, which no figure can tell from +0 (one pass fewer).
    return round_elements(scaled, f, b.work.view(torch.int32), not b.finite).div_(scale), over


def _tensorwise(f: FloatFormat) -> CastFn:
    def cast(b: Blocks, out: torch.Tensor) -> torch.Tensor | None:
        return _scaled(f, b.per_block(amax_to_scale(b.tensor_amax, f)).unsqueeze(1), b, out)[1]
    return cast


def _rowwise(f: FloatFormat) -> CastFn:
    def cast(b: Blocks, out: torch.Tensor) -> torch.Tensor | None:
        rows = b.row_blocks()
        row_amax = torch.segment_reduce(b.amax32.view(-1), "max", lengths=rows, unsafe=True)
        scale = (f.max / row_amax.double().clamp(min=EPS)).float()
        scale = torch.exp2(torch.floor(torch.log2(scale)))  # torchao's rowwise recipe
        return _scaled(f, scale.repeat_interleave(rows, output_size=b.x.shape[0]).unsqueeze(1), b,
                       out)[1]
    return cast


def _nvfp4_scales(b: Blocks) -> torch.Tensor:
    """NVFP4's tensor scale of each tensor, per block: from the amax of its finite values."""
    amax = b.tensor_amax
    if not b.finite:
        amax = torch.stack([b.finite_amax(t) if not math.isfinite(a) else amax[t]
                            for t, a in enumerate(amax.tolist())])
    return b.per_block(nvfp4_scale_of(amax)).view(-1, 1, 1)


def _block(name: str) -> CastFn:
    f = BLOCK_FORMATS[name]

    def cast(b: Blocks, out: torch.Tensor) -> torch.Tensor | None:
        if f.tensor_scale is None:
            return cast_blocks(b.x, f, b.amax32, None, out, b.scratch(*b.x.shape), b.line_sums,
                               b.finite)[1]
        shape = (-1, b.x.shape[1] // f.block_size, f.block_size)  # NVFP4: half blocks
        return cast_blocks(b.x.view(shape), f, b.amax16, _nvfp4_scales(b), out.view(shape),
                           b.scratch(*shape), b.line_sums, b.finite)[1]
    return cast


def get_cast(name: str) -> Cast:
    """A cast by name: a float format, FP8 `_tensorwise` / `_rowwise`, or a block-scaled format."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key in BLOCK_FORMATS:
        return Cast(key, _block(key))
    for how, make in (("_tensorwise", _tensorwise), ("_rowwise", _rowwise)):
        if isinstance(key, str) and key.endswith(how) and key.removesuffix(how) in _SCALED:
            return Cast(key, make(formats.get_format(key.removesuffix(how))))
    if isinstance(key, str) and key in formats.FORMATS and formats.FORMATS[key].storage:
        return Cast(key, _plain(formats.FORMATS[key]))
    allowed = [*(n for n, f in formats.FORMATS.items() if f.storage),
               *(f"{s}_{how}" for s in _SCALED for how in ("tensorwise", "rowwise")), *BLOCK_FORMATS]
    raise ValueError(f"what_if has no format {name!r}; allowed: {', '.join(allowed)}")
