"""MXFP8 training (OCP MX v1.0): Linear layers whose three GEMMs see MXFP8 e4m3 operands.

As torchao's MX training path (`mx_mm`) does: forward input @ weight^T with both cast along K
(in_features); backward grad_output @ weight with both cast along N (out_features), and
grad_output^T @ input with both cast along M (the tokens); blocks of 32, e8m0 scales (FLOOR),
products accumulated in fp32. Backends: "torchao" (its `mx_mm`: real MXFP8 GEMMs on a GPU of
compute capability >= 10.0, its emulated kernels elsewhere), "ampnb" (`ampnb.quantize` and
fp32 matmuls, any device, any shape: a dimension not a multiple of 32 ends in a shorter block).
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampnb._checks import needs_module
from ampnb.block_formats import BLOCK_FORMATS, quantize
from ampnb.display import Table, TableView
from ampnb.fp8.layers import kind_of, swap_children

MX_RECIPES = ("mxfp8",)
MX_BACKENDS = ("auto", "torchao", "ampnb")
_FMT = BLOCK_FORMATS["mxfp8_e4m3"]


def _q(x: torch.Tensor) -> torch.Tensor:
    """MXFP8 e4m3 along the last dim, as fp32 values."""
    return quantize(x.float(), _FMT)


class _MxMM(torch.autograd.Function):
    """y = x @ w^T with MXFP8 operands in all three GEMMs (the casts of `ampnb.quantize`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        x2 = x.reshape(-1, x.shape[-1])
        y = _q(x2) @ _q(w).t()
        return y.reshape(*x.shape[:-1], w.shape[0]).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_x = _q(g2) @ _q(w.t()).t()  # blocks along N
        grad_w = _q(g2.t()) @ _q(x2.t()).t()  # blocks along M
        return grad_x.reshape(x.shape).to(x.dtype), grad_w.to(w.dtype)


def torchao_mx_problem(device: torch.device) -> str:
    """Why torchao's MX training path cannot run here ('' when it can)."""
    try:
        from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any import failure means: not here
        return f"torchao's MX training path is not importable ({type(err).__name__})"
    return ""


def _torchao_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    real = x.is_cuda and torch.cuda.get_device_capability(x.device) >= (10, 0)
    kernels = KernelPreference.AUTO if real else KernelPreference.EMULATED
    return _to_mxfp8_then_scaled_mm(x, w, kernels, ScaleCalculationMode.FLOOR)


def _torchao_takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """torchao's casts take fp32/bf16 and dimensions that are whole blocks of 32 only."""
    rows = x.numel() // max(x.shape[-1], 1)
    return (x.dtype in (torch.float32, torch.bfloat16) and w.dtype == x.dtype
            and all(n % 32 == 0 for n in (*w.shape, rows)))


class MxLinear(nn.Module):
    """An nn.Linear (or Conv1D) computing in MXFP8, sharing the replaced layer's parameters."""

    def __init__(self, layer: nn.Module, backend: str = "ampnb") -> None:
        super().__init__()
        kind = kind_of(layer)
        if kind is None:
            raise ValueError(f"cannot make an MxLinear from {type(layer).__name__}; allowed: "
                             "nn.Linear or transformers' Conv1D")
        self.weight, self.bias = layer.weight, layer.bias
        self.transposed, self.backend = kind.transposed, backend
        self.ran: Counter[str] = Counter()  # forward calls per backend that computed them
        self.__dict__["source"] = layer  # not a submodule: the state_dict keys stay the same

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.t() if self.transposed else self.weight
        with torch.autocast(x.device.type, enabled=False):  # the GEMMs' dtype is MXFP8's
            if self.backend == "torchao" and _torchao_takes(x, w):
                self.ran["torchao"] += 1
                y = _torchao_mm(x, w.contiguous())
            else:
                self.ran["ampnb"] += 1
                y = _MxMM.apply(x, w)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def revert(self) -> nn.Module:
        """The layer this one replaced, holding the current parameters."""
        old = self.source
        old.weight, old.bias = self.weight, self.bias
        return old

    def extra_repr(self) -> str:
        return f"mxfp8_e4m3, blocks of 32, backend={self.backend}"


@dataclass(frozen=True, repr=False)
class MxReport(TableView):
    """Which layers run MXFP8, and which backend and why."""

    backend: str
    reason: str
    layers: tuple[str, ...]

    def table(self) -> Table:
        return Table(("layer", "format", "backend"),
                     [(n or "(the model)", "mxfp8_e4m3 x 32", self.backend) for n in self.layers],
                     caption=f"MXFP8: {len(self.layers)} layer(s), backend {self.backend}",
                     notes=(self.reason,))


def choose_mx_backend(backend: str, device: torch.device) -> tuple[str, str]:
    """(backend, why): torchao's MX path where it imports, else ampnb's emulation."""
    if backend not in MX_BACKENDS:
        raise ValueError(f"backend={backend!r} is not allowed for mxfp8; allowed: {', '.join(MX_BACKENDS)}")
    if backend == "ampnb":
        return "ampnb", "ampnb's emulation (ampnb.quantize casts, fp32 matmuls), as asked"
    problem = torchao_mx_problem(device)
    if problem:
        if backend == "torchao":
            raise ValueError(f"backend='torchao' cannot run: {problem}; allowed: 'ampnb' or 'auto'")
        return "ampnb", f"ampnb's emulation: {problem}"
    real = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (10, 0)
    kernels = "real MXFP8 GEMMs" if real else "its emulated kernels (no MXFP8 GEMM on this device)"
    return "torchao", (f"torchao's MX path with {kernels}; layers or calls it cannot take "
                       "(fp16, dimensions not multiples of 32) run ampnb's emulation")


def convert_to_mx(model: nn.Module, backend: str = "auto", inplace: bool = False
                  ) -> tuple[nn.Module, MxReport]:
    """Swap every nn.Linear / Conv1D for an MxLinear; `(model, report)`."""
    needs_module(model, "convert_to_fp8")
    p = next(model.parameters(), None)
    name, why = choose_mx_backend(backend, p.device if p is not None else torch.device("cpu"))
    target = model if inplace else copy.deepcopy(model)
    if kind_of(target) is not None:
        return MxLinear(target, name), MxReport(name, why, ("",))
    made: dict[int, MxLinear] = {}
    swaps, names = [], []
    for parent_name, parent in target.named_modules():
        for child_name, child in parent.named_children():
            if kind_of(child) is not None and not isinstance(child, MxLinear):
                swaps.append((parent, child_name, made.setdefault(id(child), MxLinear(child, name))))
                names.append(f"{parent_name}.{child_name}".lstrip("."))
    if not swaps:
        raise ValueError(f"no layer of this {type(model).__name__} can run in MXFP8; allowed: a "
                         "model with nn.Linear or transformers' Conv1D layers")
    swap_children(swaps)
    return target, MxReport(name, why, tuple(names))
