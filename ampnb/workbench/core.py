"""Workbench: a real model, optimizer, loss and batches, switched live between modes and stepped."""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ampnb.device import TF32Setting, get_device, sync, tf32_setting
from ampnb.device import tf32 as tf32_switch  # `tf32` is also a parameter and property here
from ampnb.display import Table
from ampnb.modes import PrecisionMode, get_mode
from ampnb.workbench.records import StepRecord, history_table, speedup
from ampnb.workbench.state import (
    Master,
    module_links,
    param_dtype,
    relink,
    repoint_optimizer,
    saved_bytes_meter,
    untouched,
)

# A model's parameter dtype -> the true mode that already describes it (used when mode=None).
_MODE_OF_DTYPE = {torch.float32: "32-true", torch.float16: "16-true",
                  torch.bfloat16: "bf16-true", torch.float64: "64-true"}
_NARROW = (torch.float16, torch.bfloat16)


class PrecisionLossWarning(UserWarning):
    """A switch carried lower-precision weights forward: the fp32 master could not be kept."""


def resolve_device(device: str | torch.device) -> torch.device:
    """A present device by name (ValueError names the available ones)."""
    return torch.device(get_device(str(device)).name)


def _move(data: Any, device: torch.device) -> Any:
    if isinstance(data, torch.Tensor):
        return data.to(device)
    if isinstance(data, dict):
        return type(data)({k: _move(v, device) for k, v in data.items()})
    if isinstance(data, (list, tuple)) and not hasattr(data, "_fields"):
        return type(data)(_move(v, device) for v in data)
    return data


def _first_float_dtype(data: Any) -> torch.dtype | None:
    if isinstance(data, torch.Tensor):
        return data.dtype if data.is_floating_point() else None
    items = data.values() if isinstance(data, dict) else data if isinstance(data, (list, tuple)) else ()
    for item in items:
        found = _first_float_dtype(item)
        if found is not None:
            return found
    return None


def _check_inputs(model: Any, optimizer: Any, loss_fn: Any, batches: list[Any]) -> None:
    if not isinstance(model, nn.Module) or next(iter(model.parameters()), None) is None:
        raise ValueError(f"model={type(model).__name__} is not allowed; allowed: a torch.nn.Module "
                         f"with parameters.")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer={type(optimizer).__name__} is not allowed; allowed: a "
                         f"torch.optim.Optimizer built on model.parameters().")
    own = {id(p) for p in model.parameters()}
    held = [p for g in optimizer.param_groups for p in g["params"]]
    if not held or any(id(p) not in own for p in held):
        raise ValueError(f"optimizer {type(optimizer).__name__} holds parameters that are not the "
                         f"model's; allowed: an optimizer built on model.parameters().")
    if not callable(loss_fn):
        raise ValueError(f"loss_fn={loss_fn!r} is not allowed; allowed: a callable (outputs, targets).")
    if not batches or not all(isinstance(b, (tuple, list)) and len(b) == 2 for b in batches):
        raise ValueError("batches must be a non-empty iterable of (inputs, targets) pairs.")


def _check_tf32(tf32: Any) -> bool | None:
    """True/False/'on'/'off' as a bool, None as None (the one TF32 parser; no emulation here)."""
    try:
        setting = tf32_setting(tf32)
    except ValueError:
        setting = TF32Setting.emulate  # refused below, with the Workbench's own allowed values
    if setting is TF32Setting.emulate:
        raise ValueError(f"tf32={tf32!r} is not allowed; allowed: True, False, 'on', 'off' or None "
                         "(unchanged); emulation runs in compare(tf32='emulate').")
    return None if setting is None else setting is TF32Setting.on


class Workbench:
    """Train a real model one step at a time while switching mode, device and TF32 losslessly."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable[[Any, Any], torch.Tensor], batches: Iterable[Any],
                 mode: str | int | PrecisionMode | None = None,
                 device: str | torch.device | None = None, tf32: bool = False) -> None:
        batches = batches if isinstance(batches, list) else list(batches)
        _check_inputs(model, optimizer, loss_fn, batches)
        tf32 = _check_tf32(tf32)
        dev = resolve_device(device if device is not None else next(model.parameters()).device)
        current = param_dtype(model)
        chosen = get_mode(_MODE_OF_DTYPE.get(current, "32-true") if mode is None else mode)
        chosen.check(dev)
        self.model, self.optimizer, self.loss_fn, self.batches = model, optimizer, loss_fn, batches
        self.history: list[StepRecord] = []
        self.notes: list[str] = []
        self._initial = (Master.take(model, optimizer), chosen, dev, bool(tf32))
        self._plain = (model, module_links(model))  # the module tree before any conversion
        self._start()

    # ----- settings -----------------------------------------------------------------------

    @property
    def mode(self) -> PrecisionMode:
        return self._mode

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tf32(self) -> bool:
        return self._tf32

    @property
    def param_dtype(self) -> torch.dtype:
        return param_dtype(self.model)

    def set(self, mode: str | int | PrecisionMode | None = None,
            device: str | torch.device | None = None, tf32: bool | None = None) -> tuple[str, ...]:
        """Switch mode, device and/or TF32 (None keeps each); returns what could not be kept."""
        new_mode = self._mode if mode is None else get_mode(mode)
        new_device = self._device if device is None else resolve_device(device)
        tf32 = _check_tf32(tf32)
        new_mode.check(new_device)  # everything is validated before anything changes
        if tf32 is not None:
            self._tf32 = bool(tf32)
        if new_mode is self._mode and new_device == self._device:
            return ()
        master, notes = self._current_master(new_mode)
        self._apply(new_mode, new_device, master)
        self._new_notes(notes)
        return notes

    def restore(self) -> None:
        """Back to the weights, optimizer state and settings the Workbench was made with."""
        self._start()

    # ----- running ------------------------------------------------------------------------

    def step(self) -> StepRecord:
        """Run one training step under the current settings and record it."""
        mode, device, model, opt, scaler = self._mode, self._device, self.model, self.optimizer, self.scaler
        inputs, targets = self.batches[self._cursor % len(self.batches)]
        opt.zero_grad(set_to_none=True)
        peak = device.type == "cuda"
        if peak:
            torch.cuda.reset_peak_memory_stats(device)
        scale = None if scaler is None else float(scaler.get_scale())
        with tf32_switch(self._tf32):
            sync(device)
            start = time.perf_counter()
            x = mode.convert_input(_move(inputs, device))
            y = _move(targets, device)
            with saved_bytes_meter(model) as saved:
                with mode.forward_context(device):
                    raw = model(x)
                out_dtype = _first_float_dtype(raw)
                loss = self.loss_fn(mode.convert_output(raw), y)
            if scaler is None:
                loss.backward()
                opt.step()
                skipped = False
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                # update() backs the scale off exactly when step() found inf/NaN and skipped.
                skipped = float(scaler.get_scale()) < scale
            value = float(loss.detach())
            sync(device)
            seconds = time.perf_counter() - start
        self._cursor += 1
        self._steps_here += 1
        record = StepRecord(
            step=len(self.history), loss=value, seconds=seconds, mode=mode.name, device=str(device),
            tf32=self._tf32, param_dtype=self.param_dtype, output_dtype=out_dtype, memory=saved[0],
            cuda_peak=torch.cuda.max_memory_allocated(device) if peak else None, skipped=skipped,
            scale=scale, first_after_switch=self._steps_here == 1, notes=tuple(self._pending))
        self._pending.clear()
        self.history.append(record)
        return record

    def run(self, n: int) -> list[StepRecord]:
        """Run n steps."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n={n!r} is not allowed; allowed: an integer >= 0.")
        return [self.step() for _ in range(n)]

    def probe(self, context: Callable[[], contextlib.AbstractContextManager]) -> Any:
        """Forward + backward of the next batch inside context(); no update, RNG and buffers kept."""
        inputs, targets = self.batches[self._cursor % len(self.batches)]
        mode, device = self._mode, self._device
        with untouched(self.model, device), tf32_switch(self._tf32), context() as seen:
            with mode.forward_context(device):
                raw = self.model(mode.convert_input(_move(inputs, device)))
            self.loss_fn(mode.convert_output(raw), _move(targets, device)).backward()
        return seen

    # ----- what a learner reads -----------------------------------------------------------

    def speedup(self, window: int = 10) -> float | None:
        """Measured 32-true time / current mode's time on this device (recent medians)."""
        return speedup(self.history, self._mode.name, str(self._device), window)

    def table(self, last: int | None = None) -> Table:
        return history_table(self.history, last)

    def __repr__(self) -> str:
        return (f"Workbench(mode={self._mode.name!r}, device={str(self._device)!r}, "
                f"tf32={self._tf32}, params={str(self.param_dtype).removeprefix('torch.')}, "
                f"steps={len(self.history)})")

    def _repr_html_(self) -> str:
        return self.table(last=10)._repr_html_()

    # ----- switching ----------------------------------------------------------------------

    def _start(self) -> None:
        master, mode, device, tf32 = self._initial
        self._mode, self._device, self._tf32 = None, None, tf32
        self.scaler: torch.amp.GradScaler | None = None
        self._scaler_state: dict[str, Any] | None = None
        self._cursor = 0
        self._pending: list[str] = []
        self.history.clear()
        self.notes.clear()
        self._apply(mode, device, master)

    def _current_master(self, new_mode: PrecisionMode) -> tuple[Master, tuple[str, ...]]:
        """The state to carry into new_mode, and notes on what it could not keep."""
        if self._steps_here == 0:
            master = self._master  # nothing trained since it was taken: bit-identical
        else:
            master = Master.take(self.model, self.optimizer)
        notes = []
        old = self._mode.name
        if self._steps_here and master.source_dtype in _NARROW:
            kind = str(master.source_dtype).removeprefix("torch.")
            notes.append(f"{old} -> {new_mode.name}: the weights and optimizer state after "
                         f"{self._steps_here} step(s) in {old} hold {kind} values; they are "
                         f"carried forward as the new master (the earlier fp32 master is gone).")
        if master.wide and new_mode.param_dtype != torch.float64:
            notes.append(f"{old} -> {new_mode.name}: the fp64 weights and optimizer state were "
                         f"rounded to fp32 (going back to 64-true before any step restores the fp64 values).")
        return master, tuple(notes)

    def _apply(self, mode: PrecisionMode, device: torch.device, master: Master) -> None:
        """Load master into the model in mode's dtype on device; re-point optimizer and scaler."""
        before = list(self.model.parameters())
        model, links = self._plain
        relink(links)  # undo the last mode's swaps (FP8 layers share the Parameters they wrap)
        carrier = torch.float64 if mode.param_dtype == torch.float64 else torch.float32
        model.to(device=device, dtype=carrier)
        converted = mode.convert_module(model)
        self.model = model if converted is None else converted
        # Loaded after the conversion, so each value is rounded once, from the master itself.
        master.load_into(self.model)
        repoint_optimizer(self.optimizer, before, list(self.model.parameters()),
                          master.optimizer_state())
        if self.scaler is not None and self.scaler.is_enabled():
            self._scaler_state = self.scaler.state_dict()
        self.scaler = mode.make_scaler(device)
        if self.scaler is not None and self._scaler_state:
            self.scaler.load_state_dict(self._scaler_state)  # the scale learnt so far carries on
        self._mode, self._device, self._master, self._steps_here = mode, device, master, 0

    def _new_notes(self, notes: tuple[str, ...]) -> None:
        for note in notes:
            self.notes.append(note)
            self._pending.append(note)
            warnings.warn(note, PrecisionLossWarning, stacklevel=3)

