"""An emulated FP8 Linear: e4m3 inputs and weights, e5m2 (HYBRID) output gradients, per-tensor scales.

It also stands in for transformers' Conv1D (weight stored (in, out)): the same Parameter is
used through a transposed view, so ties and optimizers survive the swap.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import IntEnum
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ampnb.formats import FloatFormat
from ampnb.fp8.autocast import fp8_active
from ampnb.fp8.backends import fp8_gpu_problem
from ampnb.fp8.layers import kind_of
from ampnb.fp8.recipe import Fp8Recipe, Scaling, from_recipe_name
from ampnb.fp8.scaling import (
    amax_to_scale,
    dequantize,
    history_to_amax,
    push_amax,
    scaled_cast,
    tensor_to_amax,
)


class Role(IntEnum):
    """The three tensors an FP8 linear layer casts, as Transformer Engine names them."""

    INPUT = 0
    WEIGHT = 1
    GRAD_OUTPUT = 2


def _mm_scaled(qa: torch.Tensor, sa: torch.Tensor, qb: torch.Tensor,
               sb: torch.Tensor) -> torch.Tensor:
    """a @ b with torch._scaled_mm on the FP8 tensors (b column-major, inverse scales)."""
    one = torch.ones((), device=qa.device)
    return torch._scaled_mm(qa.contiguous(), qb.t().contiguous().t(), scale_a=one / sa,
                            scale_b=one / sb, out_dtype=torch.float32)


# How the FP8 matmul runs: "auto" takes torch._scaled_mm on FP8 tensor cores when shapes fit;
# "dequantize" widens the FP8 values (q / scale) and multiplies in float32, as torchao's
# emulate=True does.
MATMULS = ("auto", "dequantize", "scaled_mm")


class _Fp8Matmul(torch.autograd.Function):
    """y = x W^T + b on 2-D x, with x, W cast to the forward format and dy to the backward format.

    Saved for backward: the FP8 tensors (one byte a value) and their scales, not float32 copies.
    Its output is a fresh tensor, never a view: the caller reshapes it outside, so an in-place
    write into the layer's output (wav2vec2's SpecAugment) is allowed, as after nn.Linear.
    """

    @staticmethod
    def forward(ctx: Any, x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                layer: Fp8Linear, out_dtype: torch.dtype) -> torch.Tensor:
        w = weight.t() if layer.transposed else weight  # (out, in) either way
        qx, sx = layer.cast(Role.INPUT, x2)
        qw, sw = layer.cast(Role.WEIGHT, w)
        scaled = layer.scaled_mm_here(qx, qw)
        if scaled:
            out = _mm_scaled(qx, sx, qw.t(), sw)
        else:
            out = dequantize(qx, sx) @ dequantize(qw, sw).t()
        if bias is not None:
            out += bias  # a fresh float32 product: the bias widened inside the add
        ctx.save_for_backward(qx, sx, qw, sw)
        ctx.layer, ctx.scaled = layer, scaled
        ctx.dtypes = (x2.dtype, weight.dtype, None if bias is None else bias.dtype)
        layer.observe_output(x2, w, bias, out)
        return out.to(out_dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        qx, sx, qw, sw = ctx.saved_tensors
        layer, (x_dtype, w_dtype, b_dtype) = ctx.layer, ctx.dtypes
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        qg, sg = layer.cast(Role.GRAD_OUTPUT, grad)
        grad_x = grad_w = None
        if ctx.scaled:
            grad_x = _mm_scaled(qg, sg, qw, sw) if need_x else None
            grad_w = _mm_scaled(qg.t(), sg, qx, sx) if need_w else None
        else:
            dg = dequantize(qg, sg)  # widened once for both products
            grad_x = dg @ dequantize(qw, sw) if need_x else None
            grad_w = dg.t() @ dequantize(qx, sx) if need_w else None
        # The bias gradient is a sum, not a matmul: it uses the unquantized gradient (as TE).
        grad_b = None
        if need_b and b_dtype is not None:
            grad_b = grad.sum(0, dtype=torch.float32).to(b_dtype)
        if grad_w is not None:
            grad_w = (grad_w.t().contiguous() if layer.transposed else grad_w).to(w_dtype)
        return (None if grad_x is None else grad_x.to(x_dtype)), grad_w, grad_b, None, None


class Fp8Linear(nn.Module):
    """nn.Linear whose matmuls see FP8 values scaled per tensor by an `Fp8Recipe`.

    `enabled`: True always FP8, False never, None only inside `ampnb.fp8.fp8_autocast()`
    (how Transformer Engine's layers behave, and what the transformer-engine precision uses).
    `transposed`: the weight is stored (in, out), as transformers' Conv1D stores it.
    """

    transposed: bool = False

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 recipe: Fp8Recipe | str | None = None, matmul: str = "auto",
                 device: Any = None, dtype: torch.dtype | None = None,
                 enabled: bool | None = True) -> None:
        super().__init__()
        if matmul not in MATMULS:
            raise ValueError(f"matmul={matmul!r} is not allowed; allowed: {', '.join(MATMULS)}")
        if not (enabled is None or isinstance(enabled, bool)):
            raise ValueError(f"enabled={enabled!r} is not allowed; allowed: True, False or None")
        self.in_features, self.out_features = in_features, out_features
        self.recipe = from_recipe_name(recipe)
        self.matmul_choice = matmul
        self.enabled = enabled
        self.observer: Callable[..., None] | None = None
        proto = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.weight, self.bias = proto.weight, proto.bias
        n = self.recipe.history_len
        dev = self.weight.device
        # Not in state_dict: a converted model loads and saves the same keys as the original.
        self.register_buffer("amax_history", torch.zeros(len(Role), n, device=dev),
                             persistent=False)
        # Transformer Engine starts every scale at 1 and learns it from the amax history.
        self.register_buffer("scale", torch.ones(len(Role), device=dev), persistent=False)
        self.filled = [0] * len(Role)
        self.__dict__["source"] = None  # the layer it replaced (not a submodule: no new keys)

    @classmethod
    def from_linear(cls, linear: nn.Module, recipe: Fp8Recipe | str | None = None,
                    matmul: str = "auto", enabled: bool | None = True) -> Fp8Linear:
        """An Fp8Linear sharing the Parameter objects of an nn.Linear or a transformers Conv1D."""
        kind = kind_of(linear)
        if kind is None:
            raise ValueError(f"cannot make an Fp8Linear from {type(linear).__name__}; allowed: "
                             "nn.Linear or transformers' Conv1D")
        n_in, n_out = kind.features(linear)
        new = cls(n_in, n_out, linear.bias is not None, recipe, matmul, device="meta",
                  enabled=enabled)
        new.weight, new.bias = linear.weight, linear.bias
        new.transposed = kind.transposed
        new.__dict__["source"] = linear
        dev = linear.weight.device
        new.amax_history = torch.zeros_like(new.amax_history, device=dev)
        new.scale = torch.ones_like(new.scale, device=dev)
        return new

    def revert(self) -> nn.Module:
        """The layer this one replaced (a new nn.Linear if none), holding the current parameters."""
        old = self.source
        if old is None:
            old = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                            device="meta")
        old.weight, old.bias = self.weight, self.bias
        return old

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> Fp8Linear:
        # .to(dtype) must not round the scales: they stay float32 (as in TE), only move device.
        keep = (self.amax_history, self.scale)
        super()._apply(fn, recurse)
        self.amax_history = keep[0].to(self.amax_history.device)
        self.scale = keep[1].to(self.scale.device)
        return self

    def format_of(self, role: Role) -> FloatFormat:
        r = self.recipe
        return r.backward_format if role is Role.GRAD_OUTPUT else r.forward_format

    @torch.no_grad()
    def cast(self, role: Role, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x in FP8 for `role` (a torch float8 tensor) with its scale; then learn the next scale."""
        fmt, r, i = self.format_of(role), self.recipe, int(role)
        amax = tensor_to_amax(x)
        if r.scaling is Scaling.DYNAMIC:
            scale = amax_to_scale(amax, fmt, r.margin)
            self.scale[i] = scale
        else:
            scale = self.scale[i].clone()  # the scale learnt from earlier steps
        q = scaled_cast(x, fmt, scale, saturate=True if r.saturate else None)
        # The history keeps a fixed window (TE's amax_history_len): state does not grow.
        self.amax_history[i] = push_amax(self.amax_history[i], amax, self.filled[i])
        self.filled[i] += 1
        if r.scaling is Scaling.DELAYED:
            # Delayed scaling: this step's amax only shapes the scale of the steps after it.
            best = history_to_amax(self.amax_history[i], self.filled[i], r.amax_compute_algo)
            self.scale[i] = amax_to_scale(best, fmt, r.margin, previous=scale)
        if self.observer is not None:
            self.observer(self, role, x, scale, q)
        return q, scale

    def scaled_mm_here(self, qa: torch.Tensor, qb: torch.Tensor) -> bool:
        """Whether the products run as torch._scaled_mm (FP8 tensor cores) or dequantized."""
        if self.matmul_choice != "auto":
            return self.matmul_choice == "scaled_mm"
        # cuBLASLt FP8 GEMMs want every dimension a multiple of 16; else dequantize.
        return not fp8_gpu_problem(qa.device) and all(d % 16 == 0 for d in (*qa.shape, qb.shape[0]))

    def observe_output(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       out: torch.Tensor) -> None:
        """Tell the observer the layer output next to its fp32 reference."""
        if self.observer is not None:
            with torch.no_grad():
                ref = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
            self.observer(self, None, ref, None, out)

    @property
    def fp8_now(self) -> bool:
        """Whether a forward pass here would run in FP8."""
        return fp8_active() if self.enabled is None else self.enabled

    def _plain(self, x: torch.Tensor) -> torch.Tensor:
        """The replaced layer's own forward (Conv1D's addmm, FalconLinear's), or F.linear."""
        src = self.source
        if src is not None and src.weight is self.weight and src.bias is self.bias:
            return src.forward(x)  # outside FP8 the model computes exactly as before the swap
        return F.linear(x, self.weight.t() if self.transposed else self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fp8_now:
            return self._plain(x)
        dev = x.device.type
        out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        # The FP8 casts are the precision story here: autocast must not recast inside.
        with torch.autocast(dev, enabled=False):
            out = _Fp8Matmul.apply(x.reshape(-1, x.shape[-1]), self.weight, self.bias, self,
                                   out_dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        layout = ", weight stored (in, out) as Conv1D" if self.transposed else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}{layout}, recipe={self.recipe.describe()!r}")
