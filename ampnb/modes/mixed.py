"""Mixed modes: weights stay fp32, the forward runs under torch.autocast in a low dtype."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ampnb.modes.base import (
    BF16_REQUIREMENTS,
    Availability,
    PrecisionMode,
    bf16_present,
    cast_floats,
    device_type,
    guarded,
)
from ampnb.modes.view import ModeView


class MixedMode(PrecisionMode, ModeView):
    """Weights stay fp32; forward runs under torch.autocast in the low dtype."""

    def forward_context(self, device: str | torch.device = "cpu") -> contextlib.AbstractContextManager:
        return guarded(torch.autocast(device_type(device), dtype=self.autocast_dtype))

    def convert_input(self, data: Any) -> Any:
        # Fabric casts inputs to the autocast dtype; autocast casts them again where needed.
        return cast_floats(data, self.autocast_dtype)


class Fp16Mixed(MixedMode):
    name = "16-mixed"
    aliases = (16, "16")
    autocast_dtype = torch.float16
    uses_scaler = True
    description = "fp32 weights, fp16 autocast, GradScaler against gradient underflow"
    requirements = "CUDA for speed; runs on CPU (torch >= 2.3) without native fp16 units"

    def make_scaler(self, device: str | torch.device = "cpu") -> torch.amp.GradScaler:
        return torch.amp.GradScaler(device_type(device))


class Bf16Mixed(MixedMode):
    name = "bf16-mixed"
    aliases = ("bf16",)
    autocast_dtype = torch.bfloat16
    description = "fp32 weights, bf16 autocast; bf16 has fp32's range, so no GradScaler"
    requirements = BF16_REQUIREMENTS

    def availability(self, device: str | torch.device = "cpu") -> Availability:
        return bf16_present(device, "16-mixed")
