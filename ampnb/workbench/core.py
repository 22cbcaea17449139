"""Workbench: a real model, optimizer, loss and batches, switched live between modes and stepped."""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampnb.device import TF32Setting, get_device, place_model, sync, tf32_setting
from ampnb.display import Table, TableView, dtype_name
from ampnb.fp16_kernels import Fp16Kernels, fp16_kernels_choice, fp16_kernels_note
from ampnb.instruments.memory import MemoryMeter
from ampnb.modes import PrecisionMode, get_mode
from ampnb.precision import Precision
from ampnb.putback import untouched
from ampnb.selective import matching_modules, widen_kept
from ampnb.start import Master, param_dtype
from ampnb.step import StepSettings, forward_loss, step_context
from ampnb.workbench.inputs import check_inputs, output_dtype
from ampnb.workbench.records import StepRecord, history_table, nonfinite_note, speedup
from ampnb.workbench.state import (
    all_or_nothing,
    module_links,
    nonfinite_params,
    relink,
    repoint_optimizer,
)

# A model's parameter dtype -> the true mode that already describes it (used when mode=None).
_MODE_OF_DTYPE = {torch.float32: "32-true", torch.float16: "16-true",
                  torch.bfloat16: "bf16-true", torch.float64: "64-true"}
_NARROW = (torch.float16, torch.bfloat16)


def _kept_paths(model: nn.Module, patterns: str | Iterable[str]) -> tuple[str, ...]:
    """The module paths patterns name in model ('' or () for none); ValueError if one matches none."""
    if patterns in ("", ()) or (isinstance(patterns, list) and not patterns):
        return ()
    return tuple(matching_modules(model, patterns))


class PrecisionLossWarning(UserWarning):
    """A switch carried lower-precision weights forward: the fp32 master could not be kept."""


def resolve_device(device: str | torch.device) -> torch.device:
    """A present device by name (ValueError names the available ones)."""
    return torch.device(get_device(str(device)).name)


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


@dataclass(frozen=True)
class _Checkpoint:
    """Everything a switch changes, to put back when it fails or is interrupted."""

    mode: PrecisionMode
    device: torch.device
    exact: Master          # the live values, in a form that reloads into `mode` bit for bit
    master: Master
    steps_here: int
    tf32: bool
    scaler: Any
    scaler_state: Any
    cursor: int
    grads: tuple[tuple[nn.Parameter, torch.Tensor | None], ...]
    history: tuple[StepRecord, ...]
    notes: tuple[str, ...]
    pending: tuple[str, ...]
    keep: tuple[str, ...]
    fp16_kernels: Fp16Kernels | None


class Workbench(TableView):
    """Train a real model one step at a time while switching mode, device and TF32 losslessly."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable[..., torch.Tensor] | None = None, batches: Iterable[Any] = None,
                 mode: str | int | PrecisionMode | None = None,
                 device: str | torch.device | None = None, tf32: bool = False) -> None:
        given, self._batches = check_inputs(model, optimizer, loss_fn, batches)
        tf32 = _check_tf32(tf32)
        # The device follows the data: device= only states where the model is (ValueError if not).
        self.placement = place_model(model, device)
        dev = torch.device(self.placement.device)
        current = param_dtype(model)
        described = get_mode(_MODE_OF_DTYPE.get(current, "32-true"))  # what the model is now
        chosen = described if mode is None else get_mode(mode)
        chosen.check(dev)
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.batches = given
        self.history: list[StepRecord] = []
        self.notes: list[str] = []
        self._pending: list[str] = []
        self._initial = (Master.take(model, optimizer), chosen, dev, bool(tf32))
        self._plain = (model, module_links(model))  # the module tree before any conversion
        # The model as it came, described as a mode: what an interrupted start rolls back to.
        here = dev  # where place_model found the model's parameters
        self._mode, self._device, self._tf32 = described, here, bool(tf32)
        self._master, self._steps_here, self._cursor = self._initial[0], 0, 0
        self.scaler: torch.amp.GradScaler | None = None
        self._scaler_state: dict[str, Any] | None = None
        self._keep: tuple[str, ...] = ()  # module paths kept in fp32 (Workbench.set(keep_fp32=))
        self._fp16_kernels: Fp16Kernels | None = None  # None: the process-wide setting
        all_or_nothing(self._change(lambda _cp: self._start()), self._rollback)

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
        """The dtype of the parameters (of most of them, when some are kept in fp32)."""
        return param_dtype(self.model, mostly=True)

    @property
    def keep_fp32(self) -> tuple[str, ...]:
        """Module paths that run in fp32 whatever the mode (set with `set(keep_fp32=...)`)."""
        return self._keep

    @property
    def fp16_kernels(self) -> Fp16Kernels:
        """How fp16 products run on a CPU: 'auto', 'native' or 'emulated'."""
        return fp16_kernels_choice(self._fp16_kernels)

    @property
    def kernels_note(self) -> str:
        """How the current mode's products run here ('' when nothing is emulated or slow)."""
        if self._mode.compute_dtype != torch.float16:
            return ""
        return fp16_kernels_note(self._device, self._fp16_kernels)

    def set(self, mode: str | int | PrecisionMode | None = None,
            device: str | torch.device | None = None, tf32: bool | None = None,
            keep_fp32: str | Iterable[str] | None = None,
            fp16_kernels: str | None = None) -> tuple[str, ...]:
        """Switch mode, device, TF32, modules kept in fp32 and/or fp16 kernels (None keeps each).

        `keep_fp32`: module paths or globs ('lm_head,*.norm'); '' or () keeps none.
        Returns what could not be kept.
        """
        new_mode = self._mode if mode is None else get_mode(mode)
        new_device = self._device if device is None else resolve_device(device)
        tf32 = _check_tf32(tf32)
        keep = self._keep if keep_fp32 is None else _kept_paths(self.model, keep_fp32)
        kernels = self._fp16_kernels if fp16_kernels is None else fp16_kernels_choice(fp16_kernels)
        new_mode.check(new_device)  # everything is validated before anything changes
        # The last line: past this call the switch is done or undone, never half of it.
        return all_or_nothing(self._change(lambda cp: self._switch(new_mode, new_device, tf32, cp,
                                                                   keep, kernels)),
                              self._rollback)

    def restore(self) -> None:
        """Back to the weights, optimizer state and settings the Workbench was made with."""
        all_or_nothing(self._change(lambda _cp: self._start()), self._rollback)

    # ----- running ------------------------------------------------------------------------

    def step(self) -> StepRecord:
        """Run one training step under the current settings and record it."""
        mode, device, model, opt = self._mode, self._device, self.model, self.optimizer
        batch = self._batches[self._cursor % len(self._batches)]
        settings = self._settings()
        with step_context(settings, model):
            sync(device)
            start = time.perf_counter()
            with MemoryMeter(device) as meter:
                done = settings.precision.step(model, opt, batch, self.loss_fn)
                value = float(done.loss)
            sync(device)
            seconds = time.perf_counter() - start
        out_dtype = output_dtype(done.output)
        bad = nonfinite_params(model, opt)  # said in the step that made them, not the next
        if bad:
            self.notes.append(nonfinite_note(len(self.history), mode.name, bad))
            self._pending.append(self.notes[-1])
        self._cursor += 1
        self._steps_here += 1
        record = StepRecord(
            step=len(self.history), loss=value, seconds=seconds, mode=mode.name, device=str(device),
            tf32=self._tf32, param_dtype=self.param_dtype, output_dtype=out_dtype,
            memory=meter.peak_bytes, cuda_peak=meter.cuda_peak_bytes, skipped=done.skipped,
            scale=done.scale, first_after_switch=self._steps_here == 1, notes=tuple(self._pending),
            nonfinite=bad, kernels=self.kernels_note, keep_fp32=self._keep)
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
        batch = self._batches[self._cursor % len(self._batches)]
        settings = self._settings(loss_scaling=False)  # a probe sees the gradients unscaled
        with (untouched(self.model), step_context(settings, self.model), context() as seen):
            _, loss = forward_loss(settings.precision, self.model, batch, self.loss_fn)
            settings.precision.backward(loss)
        return seen

    # ----- what a learner reads -----------------------------------------------------------

    def _settings(self, loss_scaling: bool = True) -> StepSettings:
        """What the next step runs under: the mode on its device with the Workbench's scaler
        (`loss_scaling=False`: none, for a probe)."""
        p = Precision.of(self._mode, device=self._device, loss_scaling=loss_scaling,
                         scaler=self.scaler if loss_scaling else None)
        return StepSettings(p, tf32_setting(self._tf32), self._fp16_kernels, self._keep)

    def speedup(self, window: int = 10) -> float | None:
        """Measured 32-true time / current mode's time on this device (recent medians)."""
        return speedup(self.history, self._mode.name, str(self._device), window)

    def table(self, last: int | None = None) -> Table:
        return history_table(self.history, last, str(self.placement))

    def __repr__(self) -> str:
        return (f"Workbench(mode={self._mode.name!r}, device={str(self._device)!r}, "
                f"tf32={self._tf32}, params={dtype_name(self.param_dtype)}, "
                f"steps={len(self.history)})")

    def _repr_html_(self) -> str:
        return self.table(last=10)._repr_html_()

    # ----- switching: each change is all-or-nothing (see all_or_nothing) ------------------

    def _change(self, change: Callable[[_Checkpoint], Any]) -> Callable[[], tuple[_Checkpoint, Any]]:
        """change(checkpoint) wrapped so that an exception in it puts everything back first."""
        def run() -> tuple[_Checkpoint, Any]:
            saved = self._checkpoint()
            try:
                return saved, change(saved)
            except BaseException:
                self._rollback((saved, None))
                raise
        return run

    def _checkpoint(self) -> _Checkpoint:
        # Nothing trained since the master was loaded: it reloads bit for bit (and keeps fp32
        # values a true mode rounded); else the live state, copied.
        exact = self._master if self._steps_here == 0 else Master.take(self.model, self.optimizer)
        return _Checkpoint(self._mode, self._device, exact, self._master, self._steps_here,
                           self._tf32, self.scaler, self._scaler_state, self._cursor,
                           tuple((p, p.grad) for p in self.model.parameters()),
                           tuple(self.history), tuple(self.notes), tuple(self._pending),
                           self._keep, self._fp16_kernels)

    def _rollback(self, done: tuple[_Checkpoint, Any]) -> None:
        """Put back what _checkpoint saw: the same values in the same mode, the same objects."""
        cp = done[0]
        self._keep, self._fp16_kernels = cp.keep, cp.fp16_kernels  # _apply reads _keep
        self._apply(cp.mode, cp.device, cp.exact)
        for p, g in cp.grads:
            p.grad = g
        self.scaler, self._scaler_state = cp.scaler, cp.scaler_state
        self._master, self._steps_here, self._tf32, self._cursor = (cp.master, cp.steps_here,
                                                                    cp.tf32, cp.cursor)
        self.history[:], self.notes[:], self._pending[:] = cp.history, cp.notes, cp.pending

    def _start(self) -> tuple[str, ...]:
        master, mode, device, tf32 = self._initial
        self.scaler, self._scaler_state = None, None
        self._cursor, self._tf32, self._keep, self._fp16_kernels = 0, tf32, (), None
        self._pending.clear()
        self.history.clear()
        self.notes.clear()
        self._apply(mode, device, master)
        return ()

    def _switch(self, mode: PrecisionMode, device: torch.device, tf32: bool | None,
                saved: _Checkpoint, keep: tuple[str, ...] = (),
                kernels: Fp16Kernels | None = None) -> tuple[str, ...]:
        if tf32 is not None:
            self._tf32 = bool(tf32)
        self._fp16_kernels = kernels
        # A true mode gives kept modules fp32 weights for good: a new keep list converts anew.
        rekeep = keep != self._keep and mode.param_dtype in _NARROW
        self._keep = keep
        if mode is self._mode and device == self._device and not rekeep:
            return ()
        master, notes = self._current_master(mode, saved.exact)
        self._apply(mode, device, master)
        self.notes.extend(notes)
        self._pending.extend(notes)
        for note in notes:  # inside the change: a warning turned into an error undoes it
            warnings.warn(note, PrecisionLossWarning, stacklevel=6)  # the caller of set()
        return notes

    def _current_master(self, new_mode: PrecisionMode,
                        master: Master) -> tuple[Master, tuple[str, ...]]:
        """The state to carry into new_mode (the checkpoint's), and notes on what it could not keep."""
        notes = []
        old = self._mode.name
        if self._steps_here and master.source_dtype in _NARROW:
            kind = dtype_name(master.source_dtype)
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
        for p in before:
            p.grad = None  # the last step's gradients; module.to() would convert them in place
        model, links = self._plain
        relink(links)  # undo the last mode's swaps (FP8 layers share the Parameters they wrap)
        carrier = torch.float64 if mode.param_dtype == torch.float64 else torch.float32
        model.to(device=device, dtype=carrier)
        converted = mode.convert_module(model)
        self.model = model if converted is None else converted
        if self._keep and mode.param_dtype in _NARROW:  # kept modules keep fp32 weights
            widen_kept(self.model, self._keep)  # but not weights tied to modules not kept
        # Loaded after the conversion, so each value is rounded once, from the master itself.
        master.load_into(self.model)
        repoint_optimizer(self.optimizer, before, list(self.model.parameters()),
                          master.optimizer_state())
        if self.scaler is not None and self.scaler.is_enabled():
            self._scaler_state = self.scaler.state_dict()
        self.scaler = Precision.of(mode, device=device).scaler  # a fresh one where it scales
        if self.scaler is not None and self._scaler_state:
            self.scaler.load_state_dict(self._scaler_state)  # the scale learnt so far carries on
        self._mode, self._device, self._master, self._steps_here = mode, device, master, 0
