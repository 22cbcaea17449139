"""ScalerStepper: a real torch.amp.GradScaler driven through the canonical loop, stage by stage."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ampnb._interrupt import Guard, deferred
from ampnb.batch import as_batch
from ampnb.device.placement import place_model
from ampnb.display import Table
from ampnb.modes import PrecisionMode, get_mode
from ampnb.precision import Precision
from ampnb.scaler import stages as stage_table
from ampnb.scaler.batches import BatchCycle
from ampnb.scaler.records import StageRecord, StepRecord, history_table
from ampnb.scaler.runners import INJECT
from ampnb.scaler.settings import ScalerSettings
from ampnb.scaler.state import Parts, StepState
from ampnb.step import StepSettings, all_of, backward_outside_autocast, step_context

_KEEP_STAGES = 10_000


def _resolve_device(model: torch.nn.Module, mode: Any,
                    device: str | torch.device | None) -> torch.device:
    """Where the model's parameters are (`place_model`: a stated device must agree)."""
    if next(iter(model.parameters()), None) is None:
        raise ValueError("model has no parameters; ScalerStepper needs a model with parameters.")
    if device is not None:
        try:
            stated = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device={device!r} is not a device; allowed: None (the model's), "
                             f"'cpu' or 'cuda'.") from None
        mode.check(stated)  # names missing hardware (e.g. no CUDA here) and what to use instead
    try:
        return torch.device(place_model(model, device).device)
    except ValueError as e:  # the stated device is named as the user spelled it
        raise ValueError(f"device={device!r}: {e}") from None


def _check_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer={optimizer!r} is not allowed; allowed: an optimizer "
                         f"instance, e.g. torch.optim.AdamW(model.parameters()).")
    own = {id(p) for p in model.parameters()}
    held = [p for g in optimizer.param_groups for p in g["params"]]
    if not any(id(p) in own for p in held):
        raise ValueError(f"optimizer {type(optimizer).__name__} holds {len(held)} parameters, none "
                         f"of them the model's; allowed: an optimizer built on model.parameters().")


def _resolve_enabled(mode: Any, enabled: bool | None) -> bool:
    if enabled is None:
        return bool(mode.uses_scaler)
    if enabled not in (True, False):
        raise ValueError(f"enabled={enabled!r} is not allowed; it must be None, True or False.")
    if enabled and not mode.uses_scaler:
        raise ValueError(f"enabled=True but mode {mode.name!r} does not use a GradScaler; "
                         f"allowed: enabled=True only with a mode that needs one (16-mixed).")
    return enabled


def _check_stepped_by_torch_amp(mode: Any) -> None:
    """Refuse a mode whose optimizer steps on master weights outside the torch.amp loop (APEX O2)."""
    if type(mode).master_weights is not PrecisionMode.master_weights:
        raise ValueError(f"mode {mode.name!r} steps fp32 master weights outside the torch.amp loop "
                         f"the ScalerStepper walks; allowed: a torch.amp mode (16-mixed, "
                         f"bf16-mixed, 32-true, ..., apex-O1, apex-O3); run {mode.name} in the "
                         f"Workbench or %%amp")


class ScalerStepper:
    """Walk forward, divide, scaled backward, unscale_, clip, step, update, zero_grad; record all.

    Every stage runs inside the one step's context (`ampnb.step.step_context`: TF32, the mode's
    fp16 kernels; backward with autocast off), entered once for a whole `step()` or `run(n)`.
    The stages hand each other the step through `self.state` (`ampnb.scaler.state.StepState`).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None, batches: Iterable[Any],
                 mode: Any = "16-mixed", device: str | torch.device | None = None,
                 accumulation_steps: int = 1, clip_norm: float | None = None,
                 init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 enabled: bool | None = None) -> None:
        # Everything is checked before the model, optimizer or torch state is touched.
        settings = ScalerSettings(accumulation_steps, clip_norm, init_scale, growth_factor,
                                  backoff_factor, growth_interval)
        self.mode = get_mode(mode)
        _check_stepped_by_torch_amp(self.mode)
        self.device = _resolve_device(model, self.mode, device)
        _check_optimizer(model, optimizer)
        self.enabled = _resolve_enabled(self.mode, enabled)
        self._data = BatchCycle(batches)
        try:  # the first batch says whether the batches fit the loss_fn (or the model's loss)
            as_batch(self._data[0], loss_fn)
        except ValueError as err:
            raise ValueError(f"batches[0]: {err}") from None
        self.mode.check(self.device)
        converted = self.mode.convert_module(model)
        self.model = model if converted is None else converted
        self.optimizer = optimizer
        self._loss_fn = loss_fn
        self.settings = settings
        self._running = False  # inside the step's context (entered once per step() or run(n))
        self._initial = {"model": copy.deepcopy(self.model.state_dict()),
                         "optimizer": copy.deepcopy(optimizer.state_dict())}
        self._start(settings)

    # ----- set-up -------------------------------------------------------------------------

    def _start(self, settings: ScalerSettings) -> None:
        self.settings = settings
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.enabled,
                                           **settings.scaler_kwargs())
        # The Precision that steps holds this scaler; enabled=False states no loss scaling (the
        # lesson: gradients that underflow fp16 are lost), never a disabled scaler in a Precision.
        precision = Precision.of(self.mode, device=self.device, loss_scaling=self.enabled,
                                 scaler=self.scaler if self.enabled else None)
        self._step_settings = StepSettings(precision)
        self._parts = Parts(self.model, self.optimizer, self.scaler, self._loss_fn, precision,
                            settings, self._data, list(self.model.parameters()))
        self.history: list[StepRecord] = []
        # Stage records of recent steps only, so a long Run N cannot grow memory without end.
        self.stages: deque[StageRecord] = deque(maxlen=_KEEP_STAGES)
        self._cursor = 0
        self._plan = stage_table.plan(settings.accumulation_steps)
        self.state = StepState(scale=self.scale, scale_now=self.scale)

    def reset(self, **changes: Any) -> None:
        """Back to the initial model/optimizer state, with new settings (e.g. init_scale=2.**10)."""
        bad = set(changes) - {f.name for f in dataclasses.fields(ScalerSettings)}
        if bad:
            allowed = ", ".join(f.name for f in dataclasses.fields(ScalerSettings))
            raise ValueError(f"reset() got {sorted(bad)}; allowed: {allowed}.")
        settings = dataclasses.replace(self.settings, **changes)  # validates first
        with deferred():  # all of it or, interrupted, still all of it
            self.model.load_state_dict(self._initial["model"])
            self.optimizer.load_state_dict(self._initial["optimizer"])
            self.optimizer.zero_grad(set_to_none=True)
            self._start(settings)

    # ----- what a learner reads -----------------------------------------------------------

    @property
    def scale(self) -> float:
        """The current loss scale (1.0 when the scaler is disabled)."""
        return float(self.scaler.get_scale())

    @property
    def growth_tracker(self) -> int:
        """Clean steps in a row since the last growth or backoff."""
        return int(self.scaler._get_growth_tracker())  # one read; state_dict() makes two

    @property
    def loss_fn(self) -> Callable[[Any, Any], torch.Tensor] | None:
        """The loss function (None: the model's own loss); may be replaced between stages."""
        return self._loss_fn

    @loss_fn.setter
    def loss_fn(self, fn: Callable[[Any, Any], torch.Tensor] | None) -> None:
        self._loss_fn = fn
        self._parts = dataclasses.replace(self._parts, loss_fn=fn, placed={})

    @property
    def step_index(self) -> int:
        """Index of the optimizer step under way (or the next one)."""
        return self.state.step

    @property
    def batch_index(self) -> int:
        """How many batches the forward has read (the next is this one, cycled)."""
        return self.state.batch_index

    @property
    def last_grads(self) -> dict[str, Any]:
        """The last unscale_'s gradients, 'scaled' and 'unscaled' (flat fp32), and its 'scale'."""
        return self.state.last_grads

    @property
    def next_stage_name(self) -> str:
        return self._plan[self._cursor].name

    @property
    def micro_step(self) -> int:
        """Index of the micro-step the next micro stage belongs to."""
        return min(self._cursor // len(stage_table.MICRO), self.settings.accumulation_steps - 1)

    @property
    def mid_step(self) -> bool:
        return self._cursor != 0

    @property
    def batches(self) -> list[Any]:
        """The batches read so far (all of them once an iterable is exhausted)."""
        return self._data.seen

    def batch(self, index: int) -> Any:
        """Batch `index` of the cycle, read from the iterable when needed."""
        return self._data[index]

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return self._parts.params

    @property
    def layers(self) -> list[str]:
        """Names of the modules that own trainable parameters directly (targets for inject)."""
        return [n for n, m in self.model.named_modules()
                if any(p.requires_grad for p in m.parameters(recurse=False))]

    def _loop(self) -> stage_table.Loop:
        fetch, call = stage_table.call_text(as_batch(self._data[0], self.loss_fn), self.loss_fn,
                                       self.state.loss_access)
        return stage_table.Loop(self.device.type, self.mode.autocast_dtype, self.mode.name,
                           self.settings.accumulation_steps, self.settings.clip_norm,
                           self.enabled, fetch, call)

    def listing(self) -> list[tuple[str | None, str]]:
        """The loop's code, one (stage name or None, line) per line, with this run's settings."""
        return stage_table.listing(self._loop())

    def table(self, last: int | None = None) -> Table:
        """The history as a table (`ampnb.display.Table`)."""
        return history_table(self.history, last)

    # ----- fault injection ----------------------------------------------------------------

    def inject(self, kind: str = "inf", layer: str | None = None) -> None:
        """Make the next micro-step's gradients inf or NaN (all parameters, or one layer's)."""
        if kind not in INJECT:
            raise ValueError(f"kind={kind!r} is not allowed; allowed: {', '.join(INJECT)}.")
        if layer is not None and layer not in self.layers:
            # A frozen layer (requires_grad=False) has no gradient to make inf or NaN.
            raise ValueError(f"layer={layer!r} is not a module with trainable parameters (no "
                             f"gradients to inject into); allowed: None (all) or one of "
                             f"{self.layers}.")
        self.state.injection = (kind, layer)

    # ----- running ------------------------------------------------------------------------

    def _context(self) -> contextlib.AbstractContextManager:
        """The step's context (TF32, the mode's kernels, backward with autocast off); entered
        once by the outermost of run(n), step() and next_stage()."""
        if self._running:
            return contextlib.nullcontext()
        return all_of([step_context(self._step_settings), backward_outside_autocast(),
                       Guard(self._enter_run, self._leave_run)])

    def _enter_run(self) -> None:
        self._running = True

    def _leave_run(self, _: Any) -> None:
        self._running = False

    def next_stage(self) -> StageRecord:
        """Run the next stage of the loop and return its record."""
        with self._context():
            return self._next()

    def _next(self) -> StageRecord:
        stage = self._plan[self._cursor]
        # The forward's work can be interrupted: until the stage commits, nothing kept changed.
        prepared = None if stage.prepare is None else stage.prepare(self._parts, self.state)
        # From here the stage happens and is recorded as one: an interrupt waits for its end.
        with deferred():
            return self._commit(stage, prepared)

    def _commit(self, stage: stage_table.Stage, prepared: Any) -> StageRecord:
        """Run a stage and record it; called with SIGINT held back."""
        micro = self.micro_step if stage.micro else None
        fields = stage.run(self._parts, self.state, prepared)
        state = self.state
        # The scale only changes in update(): the state's copy spares a device sync per stage.
        record = StageRecord(state.step, micro, stage.name, state.scale_now, **fields)
        self.stages.append(record)
        if state.finished is not None:  # update() wrote the step's record
            self.history.append(state.finished)
            state.finished = None
        self._cursor += 1
        if self._cursor == len(self._plan):
            self._cursor = 0
            self.state = state.next_step(state.scale_now)  # update() has read the new scale
        return record

    def _finish_step(self) -> StepRecord:
        """The current step's remaining stages (at least one), inside the step's context."""
        self._next()
        while self._cursor and self._plan[self._cursor].micro:
            self._next()
        # The boundary stages are quick (no forward or backward): one held section for them all.
        with deferred():
            while self._cursor:
                self._commit(self._plan[self._cursor], None)
        return self.history[-1]

    def step(self) -> StepRecord:
        """Finish the current optimizer step (all its remaining stages) and return its record."""
        with self._context():
            return self._finish_step()

    def run(self, n: int) -> list[StepRecord]:
        """Run n optimizer steps (in one step context: its set-up is paid once)."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"n={n!r} is not allowed; it must be an integer >= 0.")
        with self._context():
            return [self._finish_step() for _ in range(n)]

    # ----- checkpoints --------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """A deep copy of model, optimizer, scaler and the stepper's position (between steps)."""
        if self.mid_step:
            raise ValueError(f"state_dict() in the middle of step {self.step_index} (next stage "
                             f"{self.next_stage_name!r}); allowed: between steps (call .step()).")
        return copy.deepcopy({
            "mode": self.mode.name, "enabled": self.enabled,
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(), "step_index": self.step_index,
            "batch_index": self.batch_index, "settings": dataclasses.asdict(self.settings),
            # Plain dicts, so torch.load(weights_only=True) reads the checkpoint back.
            "history": [dataclasses.asdict(r) for r in self.history]})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()`: the next steps are those the saved stepper would take."""
        missing = {"mode", "enabled", "model", "optimizer", "scaler", "step_index", "batch_index",
                   "settings", "history"} - set(state)
        if missing:
            raise ValueError(f"state is missing {sorted(missing)}; allowed: a ScalerStepper.state_dict().")
        saved, here = (state["mode"], state["enabled"]), (self.mode.name, self.enabled)
        if saved != here:  # a scaler's state means nothing to a loop without one, and back
            raise ValueError(f"state was saved with mode {saved[0]!r}, scaler enabled={saved[1]}; "
                             f"allowed: this stepper's mode {here[0]!r}, enabled={here[1]}.")
        settings = ScalerSettings(**state["settings"])
        history = [r if isinstance(r, StepRecord) else StepRecord(**r) for r in state["history"]]
        optimizer_state = copy.deepcopy(state["optimizer"])
        with deferred():  # all of it or, interrupted, still all of it
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(optimizer_state)
            self.optimizer.zero_grad(set_to_none=True)
            self._start(settings)
            if self.enabled:
                self.scaler.load_state_dict(state["scaler"])
            self.state = StepState(step=state["step_index"], batch_index=state["batch_index"],
                                   scale=self.scale, scale_now=self.scale)
            self.history = history

    def __repr__(self) -> str:
        return (f"ScalerStepper(mode={self.mode.name!r}, step={self.step_index}, next stage "
                f"{self.next_stage_name!r}, scale={self.scale:g}, enabled={self.enabled})")
