"""bitsandbytes' weight formats as Lightning's `BitsandbytesPrecision` modes, emulated block-wise in torch.

The six modes: nf4, nf4-dq, fp4, fp4-dq (4-bit codes, fp32 absmax per 64 weights; -dq stores the
absmax in bitsandbytes' dynamic 8-bit map), int8 (LLM.int8: int8 weights, one fp32 scale per
output row) and int8-training (16-bit weights, quantized to int8 on the fly each forward).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from functools import cache

import torch

from ampnb.lowbit.blockwise import absmax_scale, dequantize_blockwise, dynamic_map, nearest_index

# QLoRA / bitsandbytes `create_normal_map`: the quantile that sets NF4's largest code.
NF4_OFFSET = 0.9677083
# bitsandbytes' int8 dequantization multiplies by this float32 reciprocal of 127.
INV_127 = 7.874015718698502e-3
# bitsandbytes/functional.py `get_4bit_type("fp4")`, in bit-pattern order (index = the 4-bit
# code): sign bit, then 2 exponent + 1 mantissa bits; divided by its max (12) into [-1, 1].
BNB_FP4 = (0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, -0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0)


@cache
def nf4_codebook() -> torch.Tensor:
    """The 16 NF4 values: normal quantiles, 8 positive and 7 negative plus an exact 0, in [-1, 1]."""
    pos = torch.special.ndtri(torch.linspace(NF4_OFFSET, 0.5, 9)[:-1].double())
    neg = -torch.special.ndtri(torch.linspace(NF4_OFFSET, 0.5, 8)[:-1].double())
    # float32 before normalising, as bitsandbytes does, so the values match bit for bit.
    values = torch.cat([pos, torch.zeros(1, dtype=torch.float64), neg]).float().sort().values
    return values / values.max()


@cache
def fp4_codebook() -> torch.Tensor:
    """bitsandbytes' FP4 (e2m1) values by code: the OCP e2m1 grid but for its subnormal, 0.0625/12."""
    data = torch.tensor(BNB_FP4, dtype=torch.float32)
    return data / data.abs().max()


@cache
def int8_codebook() -> torch.Tensor:
    """Symmetric int8 absmax levels k / 127, k = -127..127."""
    return torch.arange(-127, 128, dtype=torch.float32) / 127


@dataclass(frozen=True)
class LowBitFormat:
    """One of Lightning's bitsandbytes modes: code book, block size, scale storage, weight storage."""

    name: str
    code_bits: int
    blocksize: int | None  # None: one scale per output row (LLM.int8's vector-wise absmax)
    double_quant: bool = False
    dq_blocksize: int = 256  # absmax values per second-level block (bitsandbytes' quantize_4bit)
    weight_bits: int | None = None  # int8-training keeps 16-bit weights; int8 is made per forward
    description: str = ""

    @property
    def quant_type(self) -> str:
        """bitsandbytes' quant_type: 'nf4', 'fp4' or 'int8'."""
        return self.name.split("-")[0]

    @property
    def is_4bit(self) -> bool:
        return self.code_bits == 4

    def codebook(self) -> torch.Tensor:
        return _CODEBOOKS[self.quant_type]()

    def n_blocks(self, shape: torch.Size | tuple[int, ...]) -> int:
        numel = math.prod(shape)
        if self.blocksize is None:
            return shape[0] if len(shape) > 1 else 1
        return math.ceil(numel / self.blocksize)

    def scale_bits(self, shape: torch.Size | tuple[int, ...]) -> int:
        """Bits of scales stored per tensor: fp32 absmax, or 8-bit absmax + fp32 absmax2 + fp32 offset."""
        blocks = self.n_blocks(shape)
        if self.double_quant:
            return 8 * blocks + 32 * math.ceil(blocks / self.dq_blocksize) + 32
        return 32 * blocks

    def bits_per_param(self, shape: torch.Size | tuple[int, ...]) -> float:
        """Storage bits per weight, scales included (code tables are shared, not counted)."""
        numel = math.prod(shape)
        if self.weight_bits is not None:
            return float(self.weight_bits)
        return (self.code_bits * numel + self.scale_bits(shape)) / numel


_CODEBOOKS = {"nf4": nf4_codebook, "fp4": fp4_codebook, "int8": int8_codebook}

LOWBIT_FORMATS: dict[str, LowBitFormat] = {f.name: f for f in (
    LowBitFormat("nf4", 4, 64, description="4-bit NormalFloat, fp32 absmax per 64 weights"),
    LowBitFormat("nf4-dq", 4, 64, double_quant=True,
                 description="NF4, absmax in bitsandbytes' dynamic 8-bit map per 256 (QLoRA)"),
    LowBitFormat("fp4", 4, 64, description="bitsandbytes' 4-bit float (e2m1), fp32 absmax per 64"),
    LowBitFormat("fp4-dq", 4, 64, double_quant=True,
                 description="FP4, absmax in bitsandbytes' dynamic 8-bit map per 256"),
    LowBitFormat("int8", 8, None,
                 description="LLM.int8(): int8 weights, one fp32 scale per row, fp16 outliers"),
    LowBitFormat("int8-training", 8, None, weight_bits=16,
                 description="16-bit weights, int8 matmul made each forward, fp16 outliers"),
)}


def get_lowbit(fmt: str | LowBitFormat) -> LowBitFormat:
    """Look a mode (weight format) up by name."""
    if isinstance(fmt, LowBitFormat):
        return fmt
    if isinstance(fmt, str) and fmt.strip().lower() in LOWBIT_FORMATS:
        return LOWBIT_FORMATS[fmt.strip().lower()]
    raise ValueError(f"unknown low-bit format {fmt!r}; allowed: {', '.join(LOWBIT_FORMATS)}")


def double_quant_saving(blocksize: int = 64, dq_blocksize: int = 256) -> float:
    """Bits per parameter double quantization saves: 32/64 - (8/64 + 32/(64*256)) ≈ 0.373."""
    return 32 / blocksize - (8 / blocksize + 32 / (blocksize * dq_blocksize))


def _blocks(w: torch.Tensor, fmt: LowBitFormat) -> torch.Tensor:
    if fmt.blocksize is None:
        return w.reshape(w.shape[0], -1) if w.dim() > 1 else w.reshape(1, -1)
    flat = w.reshape(-1)
    pad = (-flat.numel()) % fmt.blocksize
    return torch.cat([flat, flat.new_zeros(pad)]).reshape(-1, fmt.blocksize)


def block_normalized(w: torch.Tensor, fmt: str | LowBitFormat) -> torch.Tensor:
    """Every weight divided by its block's absmax (in [-1, 1]): what the code book must cover."""
    blocks = _blocks(w.detach().float(), get_lowbit(fmt))
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    return (blocks / torch.where(absmax > 0, absmax, torch.ones_like(absmax))).reshape(-1)


@dataclass(frozen=True)
class DoubleQuant:
    """The absmax as nf4-dq / fp4-dq store it: uint8 codes, fp32 absmax per 256, one fp32 offset."""

    codes: torch.Tensor
    absmax2: torch.Tensor
    offset: torch.Tensor
    blocksize: int

    def dequantize(self) -> torch.Tensor:
        return dequantize_blockwise(self.codes, self.absmax2, dynamic_map(True), self.blocksize) + self.offset


def double_quantize(absmax: torch.Tensor, dq_blocksize: int = 256) -> DoubleQuant:
    """bitsandbytes' `compress_statistics`: mean removed, then the signed dynamic map per 256 values."""
    offset = absmax.mean()
    centred = absmax - offset
    a2, scaled = absmax_scale(centred, dq_blocksize)
    codes = nearest_index(scaled, dynamic_map(True)).to(torch.uint8)
    return DoubleQuant(codes, a2, offset, dq_blocksize)


def nearest_code(x: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Index of the nearest code book value for each x (first index on ties, like argmin)."""
    return nearest_index(x, codebook.to(x.device))


@dataclass(frozen=True)
class Quantized:
    """A weight in a low-bit format: codes, the scales used, and how to get it back."""

    fmt: LowBitFormat
    codes: torch.Tensor   # 4-bit: uint8 index into the code book (flat); int8: the int8 weight
    absmax: torch.Tensor  # per-block (per-row) scale as used, after double quantization when on
    shape: torch.Size
    dtype: torch.dtype
    dq: DoubleQuant | None = None

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight back, computed in fp32 (as bitsandbytes does), in `dtype` (default: w's)."""
        if self.fmt.is_4bit:
            values = self.fmt.codebook().to(self.codes.device)[self.codes.long()]
            n = math.prod(self.shape)
            flat = torch.cat([values, values.new_zeros((-n) % self.fmt.blocksize)])
            out = (flat.reshape(-1, self.fmt.blocksize) * self.absmax[:, None]).reshape(-1)[:n]
        else:
            out = self.codes.float() * self.absmax[:, None] * INV_127
        return out.reshape(self.shape).to(dtype or self.dtype)

    @property
    def bits_per_param(self) -> float:
        return self.fmt.bits_per_param(self.shape)


def int8_rowwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bitsandbytes' `int8_vectorwise_quant` without outliers: (int8 rows, fp32 absmax per row)."""
    rows = w.reshape(w.shape[0], -1) if w.dim() > 1 else w.reshape(1, -1)
    stats = rows.abs().amax(dim=1).float()
    # An all-zero row (a ReLU output, say) gives 0/0 in bitsandbytes' formula: codes 0, explicitly.
    scale = torch.where(stats > 0, 127.0 / stats, torch.zeros_like(stats))
    return torch.round(rows * scale[:, None]).to(torch.int8), stats


def warn_nonfinite(w: torch.Tensor, f: LowBitFormat) -> None:
    """Say so when w holds inf/NaN: its whole block (row, for int8) comes back inf/NaN."""
    bad = int((~torch.isfinite(w.detach())).sum()) if w.is_floating_point() else 0
    if bad:
        where = f"block of {f.blocksize} weights" if f.blocksize else "row"
        warnings.warn(f"{f.name}: the weight holds {bad} inf/NaN value(s); each {where} holding "
                      f"one is scaled by an inf/NaN absmax and comes back inf/NaN", RuntimeWarning,
                      stacklevel=3)


def quantize_weight(w: torch.Tensor, fmt: str | LowBitFormat) -> Quantized:
    """Quantize a weight as bitsandbytes does: block absmax, x * (1/absmax), nearest code."""
    f = get_lowbit(fmt)
    w = w.detach()
    warn_nonfinite(w, f)
    if not f.is_4bit:
        codes, stats = int8_rowwise(w.float())
        return Quantized(f, codes, stats, w.shape, w.dtype)
    absmax, scaled = absmax_scale(w.reshape(-1), f.blocksize)
    codes = nearest_code(scaled, f.codebook()).to(torch.uint8)
    dq = double_quantize(absmax, f.dq_blocksize) if f.double_quant else None
    return Quantized(f, codes, absmax if dq is None else dq.dequantize(), w.shape, w.dtype, dq)


def _bnb_roundtrip(w: torch.Tensor, f: LowBitFormat) -> torch.Tensor | None:
    """bitsandbytes' own quantize + dequantize, when it is installed and w is on CUDA."""
    if not w.is_cuda:
        return None
    try:
        import bitsandbytes.functional as bnbf
    except ImportError:
        return None
    if not f.is_4bit:
        codes, stats, _ = bnbf.int8_vectorwise_quant(w.detach().reshape(w.shape[0], -1).half())
        return bnbf.int8_vectorwise_dequant(codes, stats).reshape(w.shape).to(w.dtype)
    q, state = bnbf.quantize_4bit(w.detach(), blocksize=f.blocksize,
                                  compress_statistics=f.double_quant, quant_type=f.quant_type)
    return bnbf.dequantize_4bit(q, state).to(w.dtype)


def roundtrip(w: torch.Tensor, fmt: str | LowBitFormat, use_bitsandbytes: bool = True) -> torch.Tensor:
    """w as the low-bit format stores it (quantize then dequantize), in w's dtype."""
    f = get_lowbit(fmt)
    real = _bnb_roundtrip(w, f) if use_bitsandbytes else None
    if real is not None:
        warn_nonfinite(w, f)
    return real if real is not None else quantize_weight(w, f).dequantize()
