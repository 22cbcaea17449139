"""Emulated bitsandbytes layers: `Linear4bit` (nf4/fp4, -dq) and `Linear8bitLt` (int8, int8-training)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ampnb.lowbit.formats import (
    INV_127,
    DoubleQuant,
    LowBitFormat,
    Quantized,
    int8_rowwise,
    quantize_weight,
)
from ampnb.lowbit.int8 import THRESHOLD, int8_matmul


class _Int8Matmul(torch.autograd.Function):
    """Forward: LLM.int8(). Backward: in 16 bits against the 16-bit weight, as bitsandbytes does."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w16: torch.Tensor, bias: torch.Tensor | None,
                codes: torch.Tensor, stats: torch.Tensor, threshold: float, layer: Any) -> torch.Tensor:
        out, cols = int8_matmul(x, codes, stats, w16.detach(), bias, threshold)
        layer.outlier_features = tuple(cols.tolist())
        ctx.save_for_backward(x.to(torch.float16), w16)
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x16, w16 = ctx.saved_tensors
        g = grad.to(torch.float16)
        gx = (g @ w16.to(torch.float16)) if ctx.needs_input_grad[0] else None
        gw = (g.reshape(-1, g.shape[-1]).t() @ x16.reshape(-1, x16.shape[-1])).to(w16.dtype) \
            if ctx.needs_input_grad[1] else None
        gb = g.reshape(-1, g.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None, None, None, None


class _LowBitLinear(nn.Module):
    """Shared parts: the format, the source layout (Conv1D stores W as (in, out)), the bias."""

    fmt: LowBitFormat

    def __init__(self, fmt: LowBitFormat, in_features: int, out_features: int,
                 bias: torch.Tensor | None, transposed: bool, weight_dtype: torch.dtype) -> None:
        super().__init__()
        self.fmt, self.in_features, self.out_features = fmt, in_features, out_features
        self.transposed = transposed
        # The source layer's weight dtype: `.weight` comes back in it, so a model whose own forward
        # reads the weight (Mamba's `dt_proj.weight @ x`) meets the dtype it was written for.
        self.weight_dtype = weight_dtype
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), bias.requires_grad)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"mode={self.fmt.name!r}, bias={self.bias is not None}")

    @property
    def weight(self) -> torch.Tensor:
        """The weight the matmul uses, dequantized to the source weight's dtype, in its layout.

        For a model whose forward reads `layer.weight` itself rather than calling the layer: the
        values are those of `linear_weight()` (exact in the wider source dtype); a trainable
        weight (int8-training) takes the gradient straight through.
        """
        w = self.linear_weight().to(self.weight_dtype)
        return w.t() if self.transposed else w


class Linear4bit(_LowBitLinear):
    """bitsandbytes' `Linear4bit`: frozen 4-bit weight, dequantized to compute_dtype for each matmul."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fmt: LowBitFormat,
                 compute_dtype: torch.dtype = torch.bfloat16, transposed: bool = False) -> None:
        super().__init__(fmt, weight.shape[1], weight.shape[0], bias, transposed, weight.dtype)
        self.compute_dtype = compute_dtype
        # Lightning quantizes `weight.half()`: dequantization gives fp16 back, then compute_dtype.
        q = quantize_weight(weight.detach().half(), fmt)
        self.shape = tuple(q.shape)
        # Buffers, so .to(), deepcopy and state_dict carry the stored form (as bitsandbytes' do).
        self.register_buffer("codes", q.codes)
        if q.dq is None:
            self.register_buffer("absmax", q.absmax)
        else:
            self.register_buffer("absmax_codes", q.dq.codes)
            self.register_buffer("absmax2", q.dq.absmax2)
            self.register_buffer("absmax_offset", q.dq.offset)

    @property
    def quantized(self) -> Quantized:
        """The stored weight: 4-bit codes and the (double-quantized) block scales."""
        if not self.fmt.double_quant:
            return Quantized(self.fmt, self.codes, self.absmax, torch.Size(self.shape), torch.float16)
        dq = DoubleQuant(self.absmax_codes, self.absmax2, self.absmax_offset, self.fmt.dq_blocksize)
        return Quantized(self.fmt, self.codes, dq.dequantize(), torch.Size(self.shape), torch.float16, dq)

    def linear_weight(self) -> torch.Tensor:
        return self.quantized.dequantize().to(self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        return F.linear(x.to(self.compute_dtype), self.linear_weight(), bias).to(x.dtype)


class Linear8bitLt(_LowBitLinear):
    """bitsandbytes' `Linear8bitLt`: int8 matmul with outlier features in fp16 (threshold 6.0).

    int8: the weight is stored in int8 (frozen). int8-training: a trainable fp16 weight,
    quantized to int8 row-wise at every forward; gradients are computed in fp16.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fmt: LowBitFormat,
                 threshold: float = THRESHOLD, transposed: bool = False) -> None:
        super().__init__(fmt, weight.shape[1], weight.shape[0], bias, transposed, weight.dtype)
        self.threshold = threshold
        self.outlier_features: tuple[int, ...] = ()  # of the latest forward
        w16 = weight.detach().half()
        self.has_fp16_weights = fmt.weight_bits == 16
        if self.has_fp16_weights:
            self.weight16 = nn.Parameter(w16.clone())  # trainable, as bitsandbytes' fp16 weights
        else:
            codes, stats = int8_rowwise(w16.float())
            self.register_buffer("codes", codes)
            self.register_buffer("stats", stats)

    def _int8(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.has_fp16_weights:
            return int8_rowwise(self.weight16.detach().float())
        return self.codes, self.stats

    def linear_weight(self) -> torch.Tensor:
        """The int8 weight dequantized to fp16: what the inlier matmul computes with."""
        codes, stats = self._int8()
        return (codes.float() * stats[:, None] * INV_127).half()

    @property
    def weight(self) -> torch.Tensor:
        w = self.linear_weight()
        if self.has_fp16_weights:  # int8-training: the rounded values, the gradient to weight16
            w = self.weight16 + (w - self.weight16).detach()
        w = w.to(self.weight_dtype)
        return w.t() if self.transposed else w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        codes, stats = self._int8()
        w16 = self.weight16 if self.has_fp16_weights else self.linear_weight()
        out = _Int8Matmul.apply(x, w16, self.bias, codes, stats, self.threshold, self)
        return out.to(x.dtype)


LOWBIT_LAYERS: tuple[type[nn.Module], ...] = (Linear4bit, Linear8bitLt)
