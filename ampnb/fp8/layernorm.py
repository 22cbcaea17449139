"""Transformer Engine's LayerNorm, emulated: what Lightning's transformer-engine precision swaps in
for nn.LayerNorm alongside the Linear layers.

te.LayerNorm casts its input, weight and bias to the activation dtype (the autocast dtype when
autocast is on, else the input's), normalizes in fp32 and returns the activation dtype. It does
not compute in FP8; it differs from nn.LayerNorm under autocast, which runs and returns fp32.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def replaceable(m: nn.Module) -> bool:
    """An nn.LayerNorm (not a subclass with its own forward) that Fabric's conversion swaps."""
    return isinstance(m, nn.LayerNorm) and type(m).forward is nn.LayerNorm.forward


def unsupported_reason(m: nn.LayerNorm) -> str:
    """Why TE's LayerNorm cannot take this one ('' when it can)."""
    if m.weight is None or m.bias is None:
        return "Transformer Engine's LayerNorm needs both weight and bias (Fabric raises here)"
    if len(m.normalized_shape) != 1:
        return f"normalized_shape {tuple(m.normalized_shape)} is not one dimension"
    return ""


class TeLayerNorm(nn.Module):
    """te.LayerNorm's numerics on any device, sharing the Parameters of the nn.LayerNorm it replaces."""

    def __init__(self, layer: nn.LayerNorm) -> None:
        super().__init__()
        why = unsupported_reason(layer)
        if why:
            raise ValueError(f"cannot emulate TE's LayerNorm for {layer}: {why}")
        self.normalized_shape, self.eps = tuple(layer.normalized_shape), layer.eps
        self.weight, self.bias = layer.weight, layer.bias
        self.__dict__["source"] = layer  # not a submodule: state_dict keys stay the same

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind = x.device.type
        act = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
        with torch.autocast(kind, enabled=False):
            # Rounded to the activation dtype first (TE's cast_if_needed), then fp32 math.
            x32, w32, b32 = (t.to(act).float() for t in (x, self.weight, self.bias))
            return F.layer_norm(x32, self.normalized_shape, w32, b32, self.eps).to(act)

    def revert(self) -> nn.Module:
        """The nn.LayerNorm this one replaced, holding the current parameters."""
        old = self.source
        old.weight, old.bias = self.weight, self.bias
        return old

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps} (emulated te.LayerNorm)"
