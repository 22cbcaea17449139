"""A mode configured once with its device and its GradScaler, as Fabric's
`MixedPrecision(precision, device, scaler)` is: its hooks then take neither.

`ampnb.Precision.of("16-mixed", model=model)` binds the mode to the device the model's
parameters are on (a stated `device=` must agree) and makes the GradScaler the mode needs there.
It is the only thing inside ampnb that hands a mode its device or its scaler: the step
(`ampnb.step.train_step`, `forward_loss`, `step_context`) and every runner go through one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ampnb.batch import as_batch
from ampnb.device import place_model
from ampnb.fp16_kernels import Fp16Kernels
from ampnb.modes import PrecisionMode, get_mode
from ampnb.step import StepOutcome, train_step


@dataclass(frozen=True, eq=False)
class Precision:
    """A precision mode bound to a device and its scaler (None: the mode uses none)."""

    mode: PrecisionMode
    device: str
    scaler: torch.amp.GradScaler | None = None
    why: str = ""  # why this device (where the model's parameters are, or as stated)
    # [backwards through this object, (backwards then, optimizers' ids) at the last update]
    _iteration: list = field(default_factory=lambda: [0, None], repr=False)

    @classmethod
    def of(cls, mode: str | int | PrecisionMode, *, model: nn.Module | None = None,
           device: str | torch.device | None = None,
           scaler: torch.amp.GradScaler | None = None,
           loss_scaling: bool = True) -> Precision:
        """The mode on the model's device (or `device`, which must agree with the model's), with
        `scaler` or, where the mode needs one, a new GradScaler for that device.

        `loss_scaling=False` states that there is no loss scaling, on purpose (the
        ScalerStepper's `enabled=False` lesson: fp16 gradients that underflow are lost): no
        scaler, a plain backward and step. A scaler torch disabled is still refused.
        """
        found = get_mode(mode)
        where = place_model(model, device)
        if loss_scaling not in (True, False):
            raise ValueError(f"loss_scaling={loss_scaling!r} is not allowed; allowed: True or False")
        if not loss_scaling:
            if scaler is not None:
                raise ValueError(f"scaler={type(scaler).__name__} with loss_scaling=False; "
                                 "allowed: scaler=None (no loss scaling: no scaler)")
            return cls(found, where.device, None, where.why)
        if scaler is not None and not found.uses_scaler:
            raise ValueError(f"scaler={type(scaler).__name__} is not allowed with {found.name}; "
                             "allowed: None (only 16-mixed and its kin use a GradScaler)")
        if scaler is None:
            scaler = found.make_scaler(where.device)
        else:
            _check_scaler(scaler, where.device, where.why)
        return cls(found, where.device, scaler, where.why)

    def forward_context(self) -> contextlib.AbstractContextManager:
        """The mode's forward context on its device (autocast for the mixed modes)."""
        return self.mode.forward_context(self.device)

    def kernel_context(self, *, fp16_kernels: str | Fp16Kernels | None = None
                       ) -> contextlib.AbstractContextManager:
        """The mode's products on its device for a whole step (fp16 kernels on a CPU; None:
        the process-wide setting)."""
        return self.mode.kernel_context(self.device, fp16_kernels)

    def convert_module(self, module: nn.Module) -> nn.Module:
        return self.mode.convert_module(module)

    def convert_input(self, data: Any) -> Any:
        return self.mode.convert_input(data)

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss backward, scaled by the bound scaler where there is one."""
        self._iteration[0] += 1
        return self.mode.backward(loss, self.scaler)

    def optimizer_step(self, optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
                       before_update: Callable[[], None] | None = None) -> bool:
        """Unscale, `before_update` (clip), step or skip, update the scale. True: it stepped.

        Several optimizers in one iteration go together, `optimizer_step([opt_a, opt_b])`, as
        torch's recipe has them: each stepped (or skipped), then one update of the scale.
        """
        which = frozenset(map(id, optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]))
        self._refuse_a_second_update(optimizer, which)
        stepped = self.mode.optimizer_step(optimizer, self.scaler, before_update)
        if self.scaler is not None and self.scaler.is_enabled():
            self._iteration[1] = (self._iteration[0], which)
        return stepped

    def _refuse_a_second_update(self, optimizer: Any, which: frozenset[int]) -> None:
        """Another optimizer stepped and updated the scale since this object's last backward:
        this one's gradients were scaled by the scale before that update (torch's recipe: one
        `update()` per iteration, after every optimizer's step)."""
        last = self._iteration[1]
        if last is None or last[0] != self._iteration[0] or last[1] == which:
            return
        raise ValueError(f"optimizer_step({type(optimizer).__name__}) after another optimizer's "
                         "step already updated the scale in this iteration; step them together, "
                         "p.optimizer_step([opt_a, opt_b]) (torch's recipe: one scaler.update() "
                         "per iteration, after every optimizer's step)")

    def step(self, model: Callable[..., Any], optimizer: torch.optim.Optimizer, batch: Any,
             loss_fn: Callable[..., Any] | None = None,
             before_update: Callable[[], None] | None = None) -> StepOutcome:
        """ampnb's one training step (`ampnb.step.train_step`) with the bound device and scaler."""
        return train_step(self, model, optimizer, as_batch(batch, loss_fn), loss_fn,
                          before_update=before_update)

    def __repr__(self) -> str:
        scaler = "none" if self.scaler is None else f"GradScaler(scale={self.scaler.get_scale():g})"
        return f"Precision({self.mode.name} on {self.device}, scaler {scaler})"


def _check_scaler(scaler: torch.amp.GradScaler, device: str, why: str) -> None:
    """A scaler torch disabled, or one for another device, would train with no loss scaling."""
    where = getattr(scaler, "_device", "cuda")  # the constructor's device, as torch keeps it
    named = f"GradScaler({where!r}" + ("" if scaler.is_enabled() else ", enabled=False") + ")"
    if not scaler.is_enabled():
        raise ValueError(f"scaler={named} is disabled (torch disables a {where!r} scaler where "
                         f"{where} is absent), so 16-mixed on {device} would train with no loss "
                         f"scaling; allowed: an enabled GradScaler({torch.device(device).type!r})")
    if torch.device(where).type != torch.device(device).type:
        raise ValueError(f"scaler={named} scales on {where}, but this Precision runs on {device} "
                         f"({why}); allowed: GradScaler({torch.device(device).type!r})")
