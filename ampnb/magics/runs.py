"""What `%%amp` does with a cell: resolve its settings, run it once, or compare modes."""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import Any

import torch

from ampnb import _state
from ampnb.comparison.run import guarded
from ampnb.device import (
    TF32Setting,
    get_device,
    support,
    sync,
    tf32_context,
    tf32_effect,
    tf32_state,
)
from ampnb.device import tf32_setting as _core_tf32_setting
from ampnb.magics import instruments
from ampnb.magics.cell import Watch, compile_cell, run_cell
from ampnb.magics.report import AmpRun
from ampnb.magics.show_code import show_code
from ampnb.modes import MODES, PrecisionMode, get_mode


@dataclass(frozen=True)
class Settings:
    """A checked mode, a present device and a TF32 setting (None: leave the flags as they are)."""

    mode: PrecisionMode
    device: str
    tf32: TF32Setting | None


def mode_name(value: Any) -> str:
    """The canonical name of a mode (ValueError names the allowed ones)."""
    return get_mode(value).name


def device_name(value: Any) -> str:
    """The name of a present device; 'auto' is cuda when present, else cpu."""
    if value == "auto":
        value = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        return get_device(value).name
    except ValueError as e:
        raise ValueError(f"{e}; --device cpu runs the cell on the CPU instead") from None


def tf32_setting(value: Any) -> TF32Setting | None:
    """The core TF32 setting; '' (the unset %config default) means None, as is."""
    return None if value == "" else _core_tf32_setting(value)


def _available(mode: PrecisionMode, device: str) -> PrecisionMode:
    found = mode.availability(device)
    if not found.ok:
        instead = ""
        if found.fallback:
            flag = f"%%amp {found.fallback}" if found.fallback in MODES else f"--device {found.fallback}"
            instead = f"; `{flag}` would run instead"
        raise ValueError(f"{mode.name} cannot run on {device}: {found.reason}{instead}")
    return mode


def settings(mode: Any, device: Any, tf32: Any) -> Settings:
    """Check a mode, device and TF32 setting together (ValueError with the allowed values)."""
    dev = device_name(device)
    return Settings(_available(get_mode(mode), dev), dev, tf32_setting(tf32))


def _tf32_text(s: Settings) -> str:
    if s.tf32 is None:
        return ("on" if tf32_state().matmul else "off") + " (as is)"
    return "emulated" if s.tf32 is TF32Setting.emulate else s.tf32.value


def _notes(s: Settings, mode: PrecisionMode, emulation: Any = None) -> list[str]:
    notes = []
    found = support(mode, s.device)
    if found.ok and not found.native:
        notes.append(f"{mode.name} on {s.device}: {found.reason}")
    if mode.name.startswith("transformer-engine"):
        # %%amp cannot swap the layers of models the cell did not make; say where FP8 happens.
        notes.append(f"{mode.name}: only FP8 layers run in FP8 (convert a model with "
                     f"get_mode({mode.name!r}).convert_module(model)); plain nn.Linear layers "
                     "run in the weight dtype")
    if mode.name == "apex-O2":  # like FP8: %%amp cannot convert models the cell did not make
        notes.append("apex-O2: convert the model with get_mode('apex-O2').convert_module(model) "
                     "(fp16 but batch norm); each optimizer.step() in the cell steps fp32 masters")
    if s.tf32 == "on" and get_device(s.device).type != "cuda":
        notes.append(tf32_effect(s.device) + "; --tf32 emulate shows its rounding")
    if emulation is not None:
        notes.append(f"TF32 emulated: the fp32 inputs of {emulation.rounded_ops} matmul/convolution "
                     "calls were rounded to TF32's 10-bit mantissa")
    return notes


def _true_mode_note(mode: PrecisionMode, run_made: tuple) -> list[str]:
    dt = str(mode.param_dtype).removeprefix("torch.")
    if mode.is_mixed or dt == "float32" or not any(m.dtype == "float32" for m in run_made):
        return []
    return [f"{mode.name} sets the default dtype to {dt} while the cell runs: what the cell "
            f"creates is born {dt}; tensors and modules made before keep their dtype "
            f"(convert them with .to(torch.{dt}))"]


def _state_note(before: _state.TorchState, after: _state.TorchState) -> list[str]:
    changed = [f.name for f in fields(before) if getattr(before, f.name) != getattr(after, f.name)]
    if not changed:
        return []
    return [f"the cell itself changed global torch state ({', '.join(changed)}); "
            "%%amp restores only what it set"]


def run_once(shell: Any, cell: str, s: Settings, args: Any) -> AmpRun:
    """Run the cell once under the settings; errors in the cell propagate after restoring state."""
    __tracebackhide__ = True  # noqa: F841
    compiled = compile_cell(shell, cell)
    ns = shell.user_ns
    watch, before = Watch(ns), _state.snapshot()
    tf32 = tf32_context(s.tf32, s.device)
    probes = instruments.probes(args, s)
    dev = torch.device(s.device)
    # Entered all or none, left to the end, whatever line an interrupt lands on.
    contexts = [tf32, s.mode.module_init_context(), s.mode.forward_context(s.device),
                s.mode.master_weights(None), *probes]
    with guarded(contexts) as entered:
        try:
            sync(dev)
            t0 = time.perf_counter()
            value = run_cell(compiled, ns)
            sync(dev)
            seconds = time.perf_counter() - t0
        except BaseException as e:
            instruments.note_finding(e, probes)
            raise
    emulation = entered[0]
    made = watch.made(value)
    notes = (_notes(s, s.mode, emulation) + _true_mode_note(s.mode, made)
             + _state_note(before, _state.snapshot()))
    code = show_code(s.mode, s.device, s.tf32, cell, args.mode) if args.show_code else None
    return AmpRun(s.mode.name, s.device, _tf32_text(s), seconds, made, tuple(notes), value,
                  code=code, extras=instruments.reports(probes))
