"""A mode configured once with its device and its GradScaler, as Fabric's
`MixedPrecision(precision, device, scaler)` is: its hooks then take neither.

`ampnb.Precision.of("16-mixed", model=model)` binds the mode to the device the model's
parameters are on (a stated `device=` must agree) and makes the GradScaler the mode needs there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampnb.batch import as_batch
from ampnb.device import place
from ampnb.modes import PrecisionMode, get_mode
from ampnb.step import StepOutcome, train_step


@dataclass(frozen=True, eq=False)
class Precision:
    """A precision mode bound to a device and its scaler (None: the mode uses none)."""

    mode: PrecisionMode
    device: str
    scaler: torch.amp.GradScaler | None = None
    why: str = ""  # why this device (where the model's parameters are, or as stated)

    @classmethod
    def of(cls, mode: str | int | PrecisionMode, *, model: nn.Module | None = None,
           device: str | torch.device | None = None,
           scaler: torch.amp.GradScaler | None = None) -> Precision:
        """The mode on the model's device (or `device`, which must agree with the model's), with
        `scaler` or, where the mode needs one, a new GradScaler for that device."""
        found = get_mode(mode)
        where = place([("the model's parameters", model)] if model is not None else [], device)
        if scaler is not None and not found.uses_scaler:
            raise ValueError(f"scaler={type(scaler).__name__} is not allowed with {found.name}; "
                             "allowed: None (only 16-mixed and its kin use a GradScaler)")
        if scaler is None:
            scaler = found.make_scaler(where.device)
        return cls(found, where.device, scaler, where.why)

    def forward_context(self) -> contextlib.AbstractContextManager:
        """The mode's forward context on its device (autocast for the mixed modes)."""
        return self.mode.forward_context(self.device)

    def convert_module(self, module: nn.Module) -> nn.Module:
        return self.mode.convert_module(module)

    def convert_input(self, data: Any) -> Any:
        return self.mode.convert_input(data)

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss backward, scaled by the bound scaler where there is one."""
        return self.mode.backward(loss, self.scaler)

    def optimizer_step(self, optimizer: torch.optim.Optimizer,
                       before_update: Callable[[], None] | None = None) -> bool:
        """Unscale, `before_update` (clip), step or skip, update the scale. True: it stepped."""
        return self.mode.optimizer_step(optimizer, self.scaler, before_update)

    def step(self, model: Callable[..., Any], optimizer: torch.optim.Optimizer, batch: Any,
             loss_fn: Callable[..., Any] | None = None,
             before_update: Callable[[], None] | None = None) -> StepOutcome:
        """ampnb's one training step (`ampnb.step.train_step`) with the bound device and scaler."""
        return train_step(self.mode, model, optimizer, as_batch(batch, loss_fn), loss_fn,
                          device=self.device, scaler=self.scaler, before_update=before_update)

    def __repr__(self) -> str:
        scaler = "none" if self.scaler is None else f"GradScaler(scale={self.scaler.get_scale():g})"
        return f"Precision({self.mode.name} on {self.device}, scaler {scaler})"
