"""Block-scaled formats (MXFP8, MXFP4, NVFP4) as records, and `quantize` into them.

Sources: OCP Microscaling Formats (MX) Specification v1.0 (MXFP8 E4M3/E5M2 and MXFP4 E2M1
elements, one E8M0 power-of-two scale per 32 values); NVIDIA's NVFP4 (Transformer Engine's
NVFP4 recipe: E2M1 elements, one E4M3 scale per 16 values and one fp32 scale per tensor).
The casts are pure torch and bit-identical to torchao's reference casts (torchao 0.18,
`MXTensor.to_mx(...).dequantize()` with its default FLOOR scale, `NVFP4Tensor.to_nvfp4(...)
.dequantize()`); torchao is not needed at run time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ampnb import formats
from ampnb.display import Table
from ampnb.formats import E8M0, FloatFormat


@dataclass(frozen=True)
class BlockFormat:
    """A block-scaled format: `block_size` elements along the last axis share one scale."""

    name: str
    element: FloatFormat
    scale: FloatFormat
    block_size: int
    tensor_scale: FloatFormat | None = None  # NVFP4's second level: one fp32 scale per tensor
    axis: int = -1
    source: str = ""

    @property
    def max(self) -> float:
        """Largest magnitude one block can hold (the tensor scale at 1)."""
        return self.element.max * self.scale.max

    @property
    def smallest_scale(self) -> float:
        """The smallest block scale: e8m0's 2^-127; an e4m3 scale from its smallest normal (the
        reference cast clamps it there), at a tensor scale of 1."""
        return self.scale.smallest_subnormal if self.scale is E8M0 else self.scale.smallest_normal

    @property
    def smallest_subnormal(self) -> float:
        """Smallest nonzero magnitude: the element's smallest subnormal times the smallest scale."""
        return self.element.smallest_subnormal * self.smallest_scale

    @property
    def smallest_normal(self) -> float:
        return self.element.smallest_normal * self.smallest_scale

    @property
    def eps(self) -> float:
        return self.element.eps

    @property
    def binades(self) -> float:
        """Dynamic range over all scales: log2(max / smallest nonzero)."""
        return math.log2(self.max / self.smallest_subnormal)

    @property
    def block_binades(self) -> float:
        """Dynamic range inside one block (one scale): what an outlier leaves its neighbours."""
        return math.log2(self.element.max / self.element.smallest_subnormal)

    @property
    def bits_per_value(self) -> float:
        """Storage per element, its share of the block scale included."""
        return self.element.bits + self.scale.bits / self.block_size


_OCP = "OCP Microscaling Formats (MX) Specification v1.0"
_NV = "NVIDIA NVFP4 (Transformer Engine NVFP4 recipe)"

BLOCK_FORMATS: dict[str, BlockFormat] = {
    f.name: f
    for f in (
        BlockFormat("mxfp8_e4m3", formats.get_format("fp8_e4m3"), E8M0, 32, source=_OCP),
        BlockFormat("mxfp8_e5m2", formats.get_format("fp8_e5m2"), E8M0, 32, source=_OCP),
        BlockFormat("mxfp4", formats.get_format("fp4_e2m1"), E8M0, 32, source=_OCP),
        BlockFormat("nvfp4", formats.get_format("fp4_e2m1"), formats.get_format("fp8_e4m3"), 16,
                    tensor_scale=formats.get_format("fp32"), source=_NV),
    )
}
_BLOCK_ALIASES = {"mxfp8": "mxfp8_e4m3", "mxfp4_e2m1": "mxfp4", "nvfp4_e2m1": "nvfp4"}


def block_format(name: object) -> BlockFormat | None:
    """The block-scaled format a name means, or None when it names none."""
    if isinstance(name, BlockFormat):
        return name
    if not isinstance(name, str):
        return None
    key = name.strip().lower().replace("-", "_")
    return BLOCK_FORMATS.get(_BLOCK_ALIASES.get(key, key))


def get_format(fmt: str | torch.dtype | FloatFormat | BlockFormat) -> FloatFormat | BlockFormat:
    """Look a format up: block-scaled names, "e8m0", then every float format name or dtype."""
    found = block_format(fmt)
    if found is not None:
        return found
    if isinstance(fmt, str) and fmt.strip().lower() in ("e8m0", "fp8_e8m0", "float8_e8m0fnu"):
        return E8M0
    try:
        return formats.get_format(fmt)  # type: ignore[arg-type]
    except ValueError as err:
        raise ValueError(f"{err}; block-scaled: {', '.join(BLOCK_FORMATS)}; scale: e8m0") from None


def quantize(x: torch.Tensor, fmt: str | torch.dtype | FloatFormat | BlockFormat,
             saturate: bool | None = None, *, tensor_scale: float | torch.Tensor | None = None
             ) -> torch.Tensor:
    """Round x into a float format (`formats.quantize`) or a block-scaled one; returns x's dtype.

    Block-scaled formats work along the last dimension in blocks of `block_size`; a row whose
    length is not a multiple of it ends in a shorter block with a scale of its own (as if
    zero-padded: zeros never change a block's amax). Computed in fp32 and rounded once to x's
    dtype. NVFP4 uses the two-level scale of NVIDIA's recipe: `tensor_scale=None` takes
    amax / (448 * 6) over x's finite values (1.0 when there are none or all are zero).
    """
    f = get_format(fmt)
    if not isinstance(f, BlockFormat):
        if f is E8M0:
            raise ValueError("e8m0 is a scale format (powers of two, no sign): quantize into "
                             f"a block-scaled format instead: {', '.join(BLOCK_FORMATS)}")
        if tensor_scale is not None:
            raise ValueError(f"tensor_scale is for nvfp4 only, not {f.name}")
        return formats.quantize(x, f, saturate)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"quantize needs a floating-point tensor, got {got}")
    if saturate is not None:
        raise ValueError(f"saturate is not an option of {f.name}: its elements always saturate")
    if tensor_scale is not None and f.tensor_scale is None:
        raise ValueError(f"tensor_scale is for nvfp4 only, not {f.name}")
    if x.numel() == 0:
        return x.clone()
    return quantize_blocks(x, f, tensor_scale)[0].to(x.dtype)


def quantize_blocks(x: torch.Tensor, f: BlockFormat, tensor_scale: float | torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x quantized into f in fp32; how many values were clamped past the element's max)."""
    blocks, length = _blocks(x, f.block_size)
    amax = blocks.abs().amax(-1, keepdim=True)
    scale = None if f.tensor_scale is None else _tensor_scale(x, f, tensor_scale)
    out, clamped = cast_blocks(blocks, f, amax, scale)
    total = clamped if clamped is not None else torch.zeros((), dtype=torch.int64, device=x.device)
    return out.flatten(-2)[..., :length].reshape(x.shape), total


def _blocks(x: torch.Tensor, size: int) -> tuple[torch.Tensor, int]:
    """x as fp32 (..., blocks, size), the last block zero-padded; and the row length."""
    work = x.float().reshape(x.shape if x.dim() else (1,))
    length = work.shape[-1]
    pad = -length % size
    if pad:
        work = F.pad(work, (0, pad))
    return work.reshape(*work.shape[:-1], -1, size), length


def round_elements(v: torch.Tensor, element: FloatFormat, work: torch.Tensor | None = None,
                   signed_zero: bool = True) -> torch.Tensor:
    """Round fp32 values already clamped to the element's max onto its grid, in place: RNE.

    The step of a value's binade is a power of two read off its fp32 exponent bits (the
    subnormal step below the smallest normal), so round(v / step) * step is exact and is what
    torch's FP8 casts give (tests/test_block_formats), e2m1 included, in six passes and no mask.
    `work` (int32, v's shape) takes the steps; NaN stays NaN. `signed_zero=False` (finite v
    only) takes five: v + M - M with M = 1.5 * 2**23 * step, whose ulp is the step, so that
    fp32's own RNE addition rounds v (the same values, but a zero is always +0).
    """
    bits = torch.bitwise_and(v.view(torch.int32), 0x7F800000, out=work)
    floor = (element.min_exponent + 127) << 23  # the subnormal binade's step, as an exponent
    if not signed_zero:
        magic = bits.clamp_min_(floor).add_(((23 - element.mantissa_bits) << 23) | 0x400000)
        magic = magic.view(torch.float32)
        return v.add_(magic).sub_(magic)
    step = bits.clamp_min_(floor).sub_(element.mantissa_bits << 23).view(torch.float32)
    return v.div_(step).round_().mul_(step)


def cast_blocks(blocks: torch.Tensor, f: BlockFormat, amax: torch.Tensor,
                tensor_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                work: tuple[torch.Tensor, torch.Tensor] | None = None,
                count: Callable[[torch.Tensor], torch.Tensor] | None = None, finite: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Blocks (..., size) of fp32, each block's amax (..., 1) and NVFP4's tensor scale (one, or
    one per block) -> (the blocks rounded into f, written into `out`; `count` of the float mask
    of the values clamped past the element's max (their number by default), None when none
    was). `work` (float32, int32 scratch of the blocks' shape) saves allocations; `finite`
    (the caller knows the blocks hold no inf or NaN, and gives `out` and `work`) counts always,
    in one pass fewer and with no sync."""
    m = f.element.max
    if f.tensor_scale is None:
        down, up = _mx_scales(amax, f, finite)
        scaled = torch.div(blocks, down, out=out)
    else:
        down, up = _nvfp4_scales(amax, f, tensor_scale)
        scaled = torch.mul(blocks, down, out=out)
    if finite:  # no NaN: a value past the max is one the clamp changes
        v = torch.clamp(scaled, -m, m, out=work[0])
        mask = torch.ne(v, scaled, out=scaled)
        clamped = mask.sum(dtype=torch.int64) if count is None else count(mask)
        q = round_elements(v, f.element, scaled.view(torch.int32), signed_zero=False)
        return torch.mul(q, up, out=scaled), clamped
    clamped = None
    # Rounding is monotonic: a block's largest scaled magnitude is its amax scaled (one sync).
    peak = amax / down if f.tensor_scale is None else amax * down
    if bool((peak > m).any()):
        w = torch.abs(scaled, out=None if work is None else work[0])
        mask = torch.gt(w, m, out=w)
        clamped = mask.sum(dtype=torch.int64) if count is None else count(mask)
    scaled.clamp_(-m, m)  # in place: casts stream over big tensors
    return round_elements(scaled, f.element, None if work is None else work[1]).mul_(up), clamped


def _mx_scales(amax: torch.Tensor, f: BlockFormat, finite: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MX scale X = 2**(floor(log2(amax)) - emax_elem) (torchao's FLOOR mode): (what the
    blocks are divided by, what the rounded elements are multiplied by).

    As torchao's reference does: the exponent is read off amax's fp32 bits (so an fp32
    subnormal amax reads as 2**-127), clamped to e8m0's range; the division uses that scale
    floored at 2**-126 while dequantizing multiplies by the e8m0 value itself (2**-127 for the
    lowest), so blocks whose amax is below 2**(emax_elem - 118) come back halved. A NaN makes
    the scale NaN (the whole block is NaN); an inf saturates to +-max*scale (inf in fp32) and
    flushes the rest of its block. `finite`: the caller knows no amax is NaN.
    """
    # The biased exponent of 2**(floor(log2 amax) - emax_elem), clamped to e8m0's 0..255.
    # (An amax has no sign bit: the exponent is its bits shifted.)
    biased = amax.view(torch.int32).bitwise_right_shift(23).sub_(f.element.max_exponent).clamp_(0, 255)
    scale = biased.bitwise_left_shift(23).view(torch.float32)  # the e8m0 value, exactly
    divide_by = scale.clamp(min=2.0**-126)
    scale = torch.where(biased == 0, 2.0**-127, scale)  # e8m0's lowest is an fp32 subnormal
    return divide_by, scale if finite else torch.where(torch.isnan(amax), math.nan, scale)


def _nvfp4_scales(amax: torch.Tensor, f: BlockFormat, tensor_scale: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4: block scale amax/6 divided by the tensor scale, rounded to e4m3 (clamped to
    [smallest normal, 448], as torchao's reference does): (what the blocks are multiplied by,
    what the rounded elements are multiplied by)."""
    e4m3 = f.scale
    block_scale = (amax / f.element.max / tensor_scale).clamp(e4m3.smallest_normal, e4m3.max)
    block_scale = round_elements(block_scale, e4m3)  # = .to(float8_e4m3fn).float(), without
    # torch's per-value fp8 conversion (several times slower on a CPU)
    return (1.0 / tensor_scale) / block_scale, tensor_scale * block_scale


def _tensor_scale(x: torch.Tensor, f: BlockFormat, given: float | torch.Tensor | None) -> torch.Tensor:
    """NVFP4's fp32 per-tensor scale: the given one, else amax / (e4m3 max * e2m1 max)."""
    if given is not None:
        scale = torch.as_tensor(given, dtype=torch.float32, device=x.device)
        if scale.numel() != 1 or not bool(torch.isfinite(scale) & (scale > 0)):
            raise ValueError(f"tensor_scale must be one finite positive number, got {given!r}")
        return scale.reshape(())
    return nvfp4_tensor_scale(x, f)


def nvfp4_tensor_scale(x: torch.Tensor, f: BlockFormat | None = None) -> torch.Tensor:
    """The per-tensor scale NVFP4 uses by default: amax / (448 * 6) over x's finite values."""
    f = f or BLOCK_FORMATS["nvfp4"]
    a = x.detach().abs()
    amax = a.amax().float() if a.numel() else a.new_zeros((), dtype=torch.float32)
    if not torch.isfinite(amax):  # inf or NaN somewhere: the amax of the finite values
        amax = a.float().nan_to_num(0.0, 0.0, 0.0).amax()
    return nvfp4_scale_of(amax, f)


def nvfp4_scale_of(finite_amax: torch.Tensor, f: BlockFormat | None = None) -> torch.Tensor:
    """NVFP4's per-tensor scale from the amax of a tensor's finite values (one or many):
    amax / (448 * 6), 1.0 where the amax is 0."""
    f = f or BLOCK_FORMATS["nvfp4"]
    scale = finite_amax / (f.scale.max * f.element.max)
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def block_format_table() -> Table:
    """The block-scaled formats' figures, derived from their element and scale formats."""
    rows = [(f.name, f.element.name, f.scale.name + (" + fp32 per tensor" if f.tensor_scale else ""),
             f.block_size, f"{f.bits_per_value:g}", f"{f.element.max:g}",
             f"2^{math.log2(f.smallest_subnormal):g}", f"2^{math.log2(f.max):.4g}",
             f"{f.block_binades:g}") for f in BLOCK_FORMATS.values()]
    return Table(("format", "element", "scale", "block", "bits/value", "element max",
                  "smallest nonzero", "largest", "binades in one block"), rows,
                 caption="Block-scaled formats (figures derived from the element and scale bits)",
                 notes=(f"Sources: {_OCP}; {_NV}. NVFP4's figures at a tensor scale of 1, its "
                        "e4m3 block scale from its smallest normal 2^-6 (as torchao clamps it).",))
