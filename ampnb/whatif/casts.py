"""The casts a what-if compares: plain float casts, FP8 scaled per tensor or per row, block-scaled.

Each cast takes an fp32 tensor and its amax (`fp8.scaling.tensor_to_amax`, computed once per
tensor) and returns (its quantized values in fp32, how many values overflowed or saturated). FP8 tensorwise and rowwise scale to amax as torchao's float8 does
(`amax_to_scale`: max / amax, amax clamped at 1e-12; its rowwise recipe rounds each row's scale
down to a power of two); block-scaled formats are `ampnb.quantize`'s casts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ampnb import formats
from ampnb.block_formats import BLOCK_FORMATS, quantize_blocks
from ampnb.formats import FloatFormat
from ampnb.fp8.scaling import EPS, amax_to_scale, tensor_to_amax, widen

CastFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
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
        return self.fn(x, tensor_to_amax(x))


def _past_max(scaled: torch.Tensor, f: FloatFormat) -> torch.Tensor:
    """How many finite values round past f's max (to inf, or clamped to max)."""
    a = scaled.abs()
    over = a >= f.overflow_threshold if f.overflow_inclusive else a > f.overflow_threshold
    return over.logical_and_(a != torch.inf).sum()


def _none(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64, device=x.device)


def _below(amax: torch.Tensor, f: FloatFormat) -> bool:
    """Whether no value of a tensor with this amax can round past f's max (one sync, no pass)."""
    return bool(amax < f.overflow_threshold)


def _plain(f: FloatFormat) -> CastFn:
    def cast(x: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x.to(f.torch_dtype).float() if f.torch_dtype is not None else formats.quantize(x, f)
        return y, _none(x) if _below(amax, f) else _past_max(x, f)
    return cast


def _scaled(f: FloatFormat, scale: torch.Tensor, x: torch.Tensor, finite: bool
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """x * scale, saturated into f, divided back. Scaled to amax, a finite tensor never
    overflows (its amax lands on f's max, a rounding below the threshold)."""
    scaled = x * scale
    q = widen(scaled.clamp(-f.max, f.max).to(f.torch_dtype))
    return q.div_(scale), _none(x) if finite else _past_max(scaled, f)


def _tensorwise(f: FloatFormat) -> CastFn:
    def cast(x: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _scaled(f, amax_to_scale(amax, f), x, bool(torch.isfinite(amax)))
    return cast


def _rowwise(f: FloatFormat) -> CastFn:
    def cast(x: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = x if x.dim() else x.reshape(1)
        row_amax = rows.abs().amax(-1, keepdim=True).double()
        scale = (f.max / row_amax.clamp(min=EPS)).float()
        scale = torch.exp2(torch.floor(torch.log2(scale)))  # torchao's rowwise recipe
        y, over = _scaled(f, scale, rows, bool(torch.isfinite(amax)))
        return y.reshape(x.shape), over
    return cast


def _block(name: str) -> CastFn:
    def cast(x: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, clamped = quantize_blocks(x, BLOCK_FORMATS[name])
        return y, clamped.sum()
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
