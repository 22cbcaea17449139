"""MXFP8 training as a precision mode, named as Lightning names its Transformer Engine modes
("transformer-engine", "transformer-engine-float16"): "transformer-engine-mxfp8" is Transformer
Engine's MXFP8BlockScaling recipe with bf16 weights. Emulated by `ampnb.fp8.mx` (torchao's MX
path where it imports); not in `MODES`, so runners that sweep every mode leave it out."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ampnb._checks import needs_module
from ampnb.modes.base import Availability, cuda_present, device_type
from ampnb.modes.transformer_engine import TransformerEngine


class TransformerEngineMxfp8(TransformerEngine):
    """MXFP8 linear layers (e4m3, blocks of 32, e8m0 scales) with bf16 weights."""

    name = "transformer-engine-mxfp8"
    aliases = ("mxfp8",)
    description = ("MXFP8 matmuls (e4m3 in all three GEMMs, one e8m0 scale per 32 values, OCP MX "
                   "v1.0); other ops under autocast in the weight dtype")
    requirements = ("any device (emulated MXFP8: ampnb's casts, or torchao's MX path); real "
                    "MXFP8 GEMMs: torchao on a GPU with compute capability >= 10.0")

    def _real(self, device: str | torch.device) -> bool:
        return False  # layers are always ampnb's MxLinear (torchao's kernels inside where it runs)

    def forward_context(self, device: str | torch.device = "cpu") -> contextlib.AbstractContextManager:
        from ampnb.fp8.autocast import emulated_fp8_context

        return emulated_fp8_context(device_type(device), self.param_dtype, self.fallback_dtype)

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Swap Linear / Conv1D layers for MxLinear in place, then cast the weights to bf16."""
        needs_module(module, f"{self.name} convert_module")
        from ampnb.fp8.mx import MxLinear, convert_to_mx

        if not any(isinstance(m, MxLinear) for m in module.modules()):
            module, _ = convert_to_mx(module, "auto", inplace=True)
        return module.to(dtype=self.param_dtype)

    def availability(self, device: str | torch.device = "cpu") -> Availability:
        found = cuda_present(device)
        if not found.ok:
            return found
        from ampnb.fp8.mx import choose_mx_backend

        return Availability(True, choose_mx_backend("auto", torch.device(device))[1])


EXTRA_MODES = {m.name: m for m in (TransformerEngineMxfp8(),)}
