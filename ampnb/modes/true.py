"""True modes: everything in one dtype (module cast, default dtype set while building and in forward)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from ampnb._checks import needs_module
from ampnb.modes.base import (
    BF16_REQUIREMENTS,
    Availability,
    PrecisionMode,
    bf16_present,
    cast_floats,
    default_dtype,
)
from ampnb.modes.view import ModeView


class TrueMode(PrecisionMode, ModeView):
    """Everything in one dtype: module cast, default dtype set while building and in forward."""

    def forward_context(self, device: str | torch.device = "cpu") -> contextlib.AbstractContextManager:
        return default_dtype(self.param_dtype)

    def module_init_context(self) -> contextlib.AbstractContextManager:
        return default_dtype(self.param_dtype)

    def convert_module(self, module: nn.Module) -> nn.Module:
        needs_module(module, f"{self.name} convert_module")
        return module.to(dtype=self.param_dtype)

    def convert_input(self, data: Any) -> Any:
        return cast_floats(data, self.param_dtype)


class Fp32True(PrecisionMode, ModeView):
    name = "32-true"
    aliases = (32, "32")
    description = "fp32 everywhere (the reference)"


class Fp16True(TrueMode):
    name = "16-true"
    param_dtype = torch.float16
    description = "everything fp16: half the memory, no master weights, no loss scaling"
    requirements = "CUDA for speed; runs on CPU without native fp16 units"


class Bf16True(TrueMode):
    name = "bf16-true"
    param_dtype = torch.bfloat16
    description = "everything bf16: half the memory, updates smaller than bf16's eps are lost"
    requirements = BF16_REQUIREMENTS

    def availability(self, device: str | torch.device = "cpu") -> Availability:
        return bf16_present(device, "16-true")


class Fp64True(TrueMode):
    name = "64-true"
    aliases = (64, "64")
    param_dtype = torch.float64
    description = "fp64 everywhere: a high-accuracy reference, slow on GPUs"
