"""What the stages act on (`Parts`) and what they hand each other during a step (`StepState`).

The ScalerStepper owns both; a stage runner reads and writes only these two records (and,
through `Parts`, the user's model, optimizer and the GradScaler), never the stepper itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ampnb.batch import Batch
from ampnb.scaler.batches import BatchCycle
from ampnb.scaler.records import GradStats, StepRecord
from ampnb.scaler.settings import ScalerSettings
from ampnb.step import ModeOnDevice


@dataclass(frozen=True, eq=False)
class Parts:
    """The objects a step works on and the run's settings (fixed until a reset or a load).

    `scaler` is the stepper's GradScaler, whose stages (unscale_, step, update) are spelled out
    by hand; `precision` (an `ampnb.Precision`) runs the forward and the backward: the mode on
    its device, holding that scaler, or none when the stepper runs without loss scaling.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    precision: ModeOnDevice
    settings: ScalerSettings
    batches: BatchCycle
    params: list[torch.nn.Parameter]
    # id(raw batch) -> its Batch when already on the device (None: moved at each forward)
    placed: dict[int, Batch | None] = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return torch.device(self.precision.device)

    @property
    def enabled(self) -> bool:
        """Whether the GradScaler scales (16-mixed); disabled it hands everything back as is."""
        return self.scaler.is_enabled()


# Carried from one optimizer step to the next; every other field starts afresh each step.
_CARRIED = ("batch_index", "injection", "loss_access", "last_grads")


@dataclass(eq=False)
class StepState:
    """The optimizer step under way: what each stage leaves for the next, and the position."""

    step: int = 0                 # index of this optimizer step
    batch_index: int = 0          # the batch the next forward reads
    scale: float = 1.0            # the scale this step's backward multiplies by
    scale_now: float = 1.0        # the scale now: only update() changes it (a copy spares a sync)
    loss: torch.Tensor | None = None  # this micro-step's loss (divided once `divide` ran)
    losses: list[float] = field(default_factory=list)  # the micro-steps' forward losses
    scaled_grads: torch.Tensor | None = None  # flat fp32 gradients after the last backward
    scaled: GradStats | None = None     # their statistics (x scale)
    unscaled: GradStats | None = None   # after unscale_
    clipped: GradStats | None = None    # after clip (the unscaled ones when it does not act)
    changed: bool = False               # clipping rescaled finite gradients
    found_inf: bool = False
    skipped: bool = False
    injected: str = ""                  # what inject() put into this step's gradients
    nonfinite_weights: int = 0
    finished: StepRecord | None = None  # the step's record, once update() wrote it
    injection: tuple[str, str | None] | None = None  # (kind, layer) for the next backward
    loss_access: str = ".loss"          # how the listing reads the model's own loss
    # The last unscale_'s gradients, scaled and unscaled (flat fp32), and the scale used.
    last_grads: dict[str, Any] = field(default_factory=dict)

    def next_step(self, scale: float) -> StepState:
        """The state the next optimizer step starts from, at `scale`."""
        return StepState(step=self.step + 1, scale=scale, scale_now=scale,
                         **{name: getattr(self, name) for name in _CARRIED})
