"""APEX's O0-O3 (legacy, emulated by `ampnb.apex`): each runs where its native counterpart runs."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from ampnb import apex
from ampnb._checks import needs_module
from ampnb.display import Table
from ampnb.modes.base import Availability, PrecisionMode, cast_floats, device_type
from ampnb.modes.mixed import Fp16Mixed
from ampnb.modes.true import Fp16True, Fp32True
from ampnb.modes.view import ModeView


class _Legacy:
    """APEX's levels: they run where their native counterpart runs, labelled legacy."""

    def availability(self, device: str | torch.device = "cpu") -> Availability:
        found = super().availability(device)
        return Availability(True, apex.LEGACY) if found.ok else found


class ApexO0(_Legacy, Fp32True):
    name = "apex-O0"
    aliases = ("apex-o0",)
    description = f"APEX O0, {apex.LEGACY}: fp32 training"


class ApexO1(_Legacy, Fp16Mixed):
    name = "apex-O1"
    aliases = ("apex-o1",)
    description = (f"APEX O1, {apex.LEGACY}: fp32 weights, fp16 autocast (APEX patched torch "
                   "functions with its own op lists), dynamic loss scaling")


class ApexO2(_Legacy, PrecisionMode, ModeView):
    """fp16 weights except batch norm, fp32 master weights in the optimizer, dynamic loss scaling."""

    name = "apex-O2"
    aliases = ("apex-o2", "apex")  # Lightning 1.x: amp_backend="apex" defaulted to amp_level="O2"
    param_dtype = torch.float16
    uses_scaler = True
    description = (f"APEX O2, {apex.LEGACY}: fp16 weights (batch norm fp32), fp32 master weights "
                   "in the optimizer, dynamic loss scaling")
    requirements = Fp16Mixed.requirements

    def convert_module(self, module: nn.Module) -> nn.Module:
        needs_module(module, f"{self.name} convert_module")
        return apex.half_except_batchnorm(module)

    def convert_input(self, data: Any) -> Any:
        return cast_floats(data, torch.float16)  # APEX patched forward to cast inputs to fp16

    def make_scaler(self, device: str | torch.device = "cpu") -> torch.amp.GradScaler:
        return torch.amp.GradScaler(device_type(device))

    def master_weights(self, optimizer: torch.optim.Optimizer | None) -> contextlib.AbstractContextManager:
        return apex.master_step_hooks() if optimizer is None else apex.master_step(optimizer)

    def table(self) -> Table:
        found = super().table()
        rows = (*found.rows, ("master weights", "fp32, in the optimizer"), ("batch norm", "fp32"))
        return Table(found.headers, rows, caption=found.caption)


class ApexO3(_Legacy, Fp16True):
    name = "apex-O3"
    aliases = ("apex-o3",)
    description = f"APEX O3, {apex.LEGACY}: pure fp16, no master weights, static loss scale 1"
