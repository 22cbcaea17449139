"""Weight-only low-bit formats (bitsandbytes' nf4, nf4-dq, fp4, int8), emulated block-wise in torch."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import torch

from ampnb.formats import get_format, quantize

# QLoRA / bitsandbytes `create_normal_map`: the quantile that sets NF4's largest code.
NF4_OFFSET = 0.9677083


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
    """Every OCP FP4 (e2m1) value, from the format table, divided by its max into [-1, 1]."""
    f = get_format("fp4_e2m1")
    grid = torch.linspace(-f.max, f.max, 2 ** (f.bits + 6) + 1)
    return torch.unique(quantize(grid, f)) / f.max


@cache
def int8_codebook() -> torch.Tensor:
    """Symmetric int8 absmax levels k / 127, k = -127..127."""
    return torch.arange(-127, 128, dtype=torch.float32) / 127


@dataclass(frozen=True)
class LowBitFormat:
    """A block-wise absmax weight format: code bits, code book, block size, scale storage."""

    name: str
    code_bits: int
    blocksize: int | None  # None: one scale per output row (LLM.int8's vector-wise absmax)
    double_quant: bool = False
    dq_blocksize: int = 256  # absmax values per second-level block (QLoRA)
    description: str = ""

    def codebook(self) -> torch.Tensor:
        return _CODEBOOKS[self.name.removesuffix("-dq")]()

    def n_blocks(self, shape: torch.Size | tuple[int, ...]) -> int:
        numel = math.prod(shape)
        if self.blocksize is None:
            return shape[0] if len(shape) > 1 else 1
        return math.ceil(numel / self.blocksize)

    def bits_per_param(self, shape: torch.Size | tuple[int, ...]) -> float:
        """Storage bits per weight, scales included (fp32 absmax, or 8-bit + fp32 when double)."""
        numel, blocks = math.prod(shape), self.n_blocks(shape)
        if self.double_quant:
            # 8-bit absmax per block, an fp32 scale per dq block, and one fp32 mean offset.
            scale_bits = 8 * blocks + 32 * math.ceil(blocks / self.dq_blocksize) + 32
        else:
            scale_bits = 32 * blocks
        return (self.code_bits * numel + scale_bits) / numel


_CODEBOOKS = {"nf4": nf4_codebook, "fp4": fp4_codebook, "int8": int8_codebook}

LOWBIT_FORMATS: dict[str, LowBitFormat] = {f.name: f for f in (
    LowBitFormat("nf4", 4, 64, description="4-bit NormalFloat, fp32 absmax per 64 weights"),
    LowBitFormat("nf4-dq", 4, 64, double_quant=True,
                 description="NF4 with the absmax scales themselves quantized to 8 bits (QLoRA)"),
    LowBitFormat("fp4", 4, 64, description="4-bit float (OCP e2m1), fp32 absmax per 64 weights"),
    LowBitFormat("int8", 8, None, description="int8 absmax, one fp32 scale per output row"),
)}


def get_lowbit(fmt: str | LowBitFormat) -> LowBitFormat:
    """Look a weight format up by name."""
    if isinstance(fmt, LowBitFormat):
        return fmt
    if isinstance(fmt, str) and fmt.strip().lower() in LOWBIT_FORMATS:
        return LOWBIT_FORMATS[fmt.strip().lower()]
    raise ValueError(f"unknown low-bit format {fmt!r}; allowed: {', '.join(LOWBIT_FORMATS)}")


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


def _double_quantize(absmax: torch.Tensor, dq_blocksize: int) -> torch.Tensor:
    """absmax after QLoRA-style double quantization: mean removed, int8 absmax per dq block."""
    offset = absmax.mean()
    centred = absmax - offset
    pad = (-centred.numel()) % dq_blocksize
    blocks = torch.cat([centred, centred.new_zeros(pad)]).reshape(-1, dq_blocksize)
    s2 = blocks.abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    back = torch.round(blocks / s2 * 127) * s2 / 127
    return back.reshape(-1)[: absmax.numel()] + offset


def nearest_code(x: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Index of the nearest code book value for each x (x already divided by its absmax)."""
    midpoints = (codebook[1:] + codebook[:-1]) / 2
    return torch.bucketize(x.contiguous(), midpoints.to(x.device))


@dataclass(frozen=True)
class Quantized:
    """A weight in a low-bit format: code indices, the scales used, and how to get it back."""

    fmt: LowBitFormat
    codes: torch.Tensor   # uint8 index into the code book, one per weight (block layout)
    absmax: torch.Tensor  # per-block scale as stored (after double quantization when on)
    shape: torch.Size
    dtype: torch.dtype

    def dequantize(self) -> torch.Tensor:
        values = self.fmt.codebook().to(self.absmax.device)[self.codes.long()]
        flat = (values * self.absmax[:, None]).reshape(-1)[: math.prod(self.shape)]
        return flat.reshape(self.shape).to(self.dtype)

    @property
    def bits_per_param(self) -> float:
        return self.fmt.bits_per_param(self.shape)


def quantize_weight(w: torch.Tensor, fmt: str | LowBitFormat) -> Quantized:
    """Block-wise absmax quantization of a weight into a low-bit format."""
    f = get_lowbit(fmt)
    blocks = _blocks(w.detach().float(), f)
    absmax = blocks.abs().amax(dim=1)
    if f.double_quant:
        absmax = _double_quantize(absmax, f.dq_blocksize)
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    codes = nearest_code(blocks / safe[:, None], f.codebook()).to(torch.uint8)
    return Quantized(f, codes, absmax, w.shape, w.dtype)


def _bnb_roundtrip(w: torch.Tensor, f: LowBitFormat) -> torch.Tensor | None:
    """bitsandbytes' own 4-bit quantize + dequantize, when it is installed and w is on CUDA."""
    # Only NF4: bitsandbytes' "fp4" has its own code book, not the OCP e2m1 grid used here.
    if not (w.is_cuda and f.name.startswith("nf4")):
        return None
    try:
        import bitsandbytes.functional as bnbf
    except ImportError:
        return None
    q, state = bnbf.quantize_4bit(w.detach(), blocksize=f.blocksize,
                                  compress_statistics=f.double_quant,
                                  quant_type=f.name.removesuffix("-dq"))
    return bnbf.dequantize_4bit(q, state).to(w.dtype)


def roundtrip(w: torch.Tensor, fmt: str | LowBitFormat, use_bitsandbytes: bool = True) -> torch.Tensor:
    """w as the low-bit format stores it (quantize then dequantize), in w's dtype."""
    f = get_lowbit(fmt)
    real = _bnb_roundtrip(w, f) if use_bitsandbytes else None
    return real if real is not None else quantize_weight(w, f).dequantize()
