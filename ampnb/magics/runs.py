"""What `%%amp` does with a cell: resolve its settings, run it once, or compare modes."""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from typing import Any

import torch
from IPython.core.error import UsageError
from torch import nn

from ampnb import putback_state
from ampnb._kernels import without_override_frames
from ampnb._tree import named_tensors
from ampnb.comparison.snapshot import cell_models, module_roots, used_names
from ampnb.device import (
    Placement,
    TF32Setting,
    TF32State,
    cpu_features,
    for_ranks,
    get_device,
    place,
    support,
    sync,
    tf32_context,
    tf32_effect,
    tf32_state,
)
from ampnb.device import tf32_setting as _core_tf32_setting
from ampnb.fp16_kernels import Fp16Kernels, fp16_kernels_choice, fp16_kernels_note, native_slowdown
from ampnb.magics import instruments
from ampnb.magics.cell import Watch, compile_cell, run_cell
from ampnb.magics.report import AmpRun
from ampnb.magics.show_code import show_code
from ampnb.modes import MODES, PrecisionMode, get_mode
from ampnb.precision import Precision
from ampnb.selective import keep_patterns, matching_modules
from ampnb.step import StepSettings, all_of, cell_context


def mode_name(value: Any) -> str:
    """The canonical name of a mode (ValueError names the allowed ones)."""
    return get_mode(value).name


def device_name(value: Any) -> str:
    """The name of a present device (ValueError names the available ones)."""
    try:
        return get_device(value).name
    except ValueError as e:
        raise ValueError(f"{e}; --device cpu runs the cell on the CPU instead") from None


def placement(device: Any, ns: dict[str, Any] | None = None,
              names: frozenset[str] = frozenset(), ranks: bool = False) -> Placement:
    """Where a cell runs: where the models (else the tensors) it uses are; `device` ('auto': not
    stated) only states it (ValueError naming both when they disagree)."""
    stated = None if device == "auto" else device_name(device)
    used = used_names(names, ns) if ns is not None else set()
    models = module_roots(ns, used) if used else {}
    found = [(f"the parameters of {', '.join(models)}", list(models.values()))] if models else []
    free = {n: ns[n] for n in sorted(used) if not n.startswith("_") and n in ns
            and not isinstance(ns[n], nn.Module) and named_tensors(ns[n], n)}
    if free:  # where no model holds parameters (nn.ReLU(), or none), the tensors decide
        found.append((f"the tensors the cell uses ({', '.join(free)})", list(free.values())))
    return (for_ranks if ranks else place)(
        found, stated, flag="--device ", fallback="the cell uses no model or tensor made before it")


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


def settings(mode: Any, device: Any, tf32: Any, fp16_kernels: Any = None,
             keep_fp32: str | None = None) -> StepSettings:
    """Check a mode, device ('auto': torch's default) and TF32 setting together (ValueError
    with the allowed values)."""
    dev = placement(device).device if device == "auto" else device_name(device)
    kernels = None if fp16_kernels is None else fp16_kernels_choice(fp16_kernels)
    # IPython's argument parser keeps the quotes of --keep-fp32 "lm_head,*.norm"
    keep = () if keep_fp32 is None else keep_patterns(keep_fp32.strip().strip("'\""))
    return StepSettings(Precision.of(_available(get_mode(mode), dev), device=dev),
                        tf32_setting(tf32), kernels, keep)


def kept_modules(s: StepSettings, ns: dict[str, Any], names: Any) -> dict[str, nn.Module]:
    """The models the cell uses (by name) when --keep-fp32 is given, else {}; ValueError if none."""
    return cell_models(s.keep_fp32, ns, names)


def mode_notes(s: StepSettings, mode: PrecisionMode, models: dict[str, nn.Module]) -> list[str]:
    """How the mode's products ran here, and which modules ran in fp32."""
    notes = []
    if mode.compute_dtype == torch.float16 and (said := fp16_kernels_note(s.device, s.fp16_kernels)):
        notes.append(f"{mode.name}: {said}")
    if models and mode.name != "32-true":
        notes.append(f"kept in fp32: {', '.join(matching_modules(models, s.keep_fp32))}")
    return notes


def _tf32_text(s: StepSettings, state: putback_state.TorchState | None = None) -> str:
    """TF32 as the cell ran it; `state`: a snapshot taken after the cell (read anew if None)."""
    if s.tf32 is None:
        return ("on" if _matmul_tf32(state) else "off") + " (as is)"
    return "emulated" if s.tf32 is TF32Setting.emulate else s.tf32.value


def _matmul_tf32(state: putback_state.TorchState | None) -> bool:
    """Whether fp32 matmuls may use TF32, from the snapshot the cell's state note reads anyway."""
    if state is None or state.matmul_precision is None:  # torch refused: the switch reads past it
        return tf32_state().matmul
    pairs = tuple(p for p in state.fp32_precision_pairs if p[2] is not None)
    return TF32State(state.matmul_precision, bool(state.cudnn_allow_tf32), pairs).matmul


@functools.lru_cache(maxsize=64)
def _support_note(mode: PrecisionMode, device: str, fp16_kernels: Fp16Kernels,
                  features: frozenset[str]) -> str:
    """How the mode runs on the device when not natively ('' when natively): the same for
    every cell under the same process-wide fp16 kernels and CPU features, so read once."""
    found = support(mode, device)
    # fp16 on a CPU: mode_notes says how its products ran under this run's --fp16-kernels
    kernels = fp16_kernels_note(device, fp16_kernels)  # '' off the CPU
    said_by_mode_notes = bool(kernels) and kernels in found.reason
    if found.ok and not found.native and not said_by_mode_notes:
        return f"{mode.name} on {device}: {found.reason}"
    return ""


def measure_apart(modes: Iterable[PrecisionMode], device: str) -> None:
    """Take the notes' one measurement (fp16's native slowdown, timed once per process) in a
    thread of its own: torch's dispatch and function modes, autocast and grad mode are per
    thread, so none the user has entered around the cell sees its matmuls."""
    if (get_device(device).type != "cpu" or native_slowdown.cache_info().currsize
            or all(m.compute_dtype != torch.float16 for m in modes)):
        return
    with ThreadPoolExecutor(1, thread_name_prefix="ampnb-probe") as apart:
        apart.submit(native_slowdown).result()


def _notes(s: StepSettings, mode: PrecisionMode, emulation: Any = None) -> list[str]:
    notes = []
    if said := _support_note(mode, s.device, fp16_kernels_choice(), cpu_features()):
        notes.append(said)
    if mode.name.startswith("transformer-engine"):
        # %%amp cannot swap the layers of models the cell did not make; say where FP8 happens.
        notes.append(f"{mode.name}: only FP8 layers run in FP8 (convert a model with "
                     f"get_mode({mode.name!r}).convert_module(model)); plain nn.Linear layers "
                     "run in the weight dtype")
    if mode.name == "apex-O2":  # like FP8: %%amp cannot convert models the cell did not make
        notes.append("apex-O2: convert the model with get_mode('apex-O2').convert_module(model) "
                     "(fp16 but batch norm); each optimizer.step() in the cell steps fp32 masters")
    if s.tf32 == "on" and get_device(s.device).type != "cuda":
        with tf32_context(s.tf32, s.device):  # the switch as the cell had it, not as restored
            said = tf32_effect(s.device)
        notes.append(said + "; --tf32 emulate shows its rounding")
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


def _dtype_note(kept: Any) -> list[str]:
    """The default dtype the cell set, put back as after every %%amp cell."""
    if kept.left is None or kept.left == kept.before:
        return []
    left, back = (str(d).removeprefix("torch.") for d in (kept.left, kept.before))
    return [f"the cell set the default dtype to {left}; put back to {back} after it, as under "
            "every mode (set it outside %%amp to keep it)"]


def _state_note(before: putback_state.TorchState, after: putback_state.TorchState) -> list[str]:
    changed = [f.name for f in fields(before) if getattr(before, f.name) != getattr(after, f.name)]
    if not changed:
        return []
    return [f"the cell itself changed global torch state ({', '.join(changed)}); "
            "%%amp restores only what it set"]


def run_once(shell: Any, cell: str, s: StepSettings, args: Any,
             where: Placement | None = None) -> AmpRun:
    """Run the cell once under the settings; errors in the cell propagate after restoring state."""
    __tracebackhide__ = True  # noqa: F841
    compiled = compile_cell(shell, cell)
    ns = shell.user_ns
    measure_apart([s.mode], s.device)
    watch, before = Watch(ns), putback_state.torch_state()
    probes = instruments.probes(args, s)
    dev = torch.device(s.device)
    try:
        models = kept_modules(s, ns, compiled.names)
    except ValueError as e:
        raise UsageError(str(e)) from None
    # Entered all or none, left to the end, whatever line an interrupt lands on.
    with all_of([cell_context(s, models), *probes]) as entered:
        try:
            sync(dev)
            t0 = time.perf_counter()
            value = run_cell(compiled, ns)
            sync(dev)
            seconds = time.perf_counter() - t0
        except BaseException as e:
            instruments.note_finding(e, probes)
            without_override_frames(e)  # in place: the user's error ends at the user's line
            raise
    emulation, kept = entered[0][0], entered[0][-1]
    made = watch.made(value)
    after = putback_state.torch_state()
    notes = (_notes(s, s.mode, emulation) + mode_notes(s, s.mode, models)
             + _true_mode_note(s.mode, made) + _dtype_note(kept) + _state_note(before, after))
    code = show_code(s.mode, s.device, s.tf32, cell, args.mode) if args.show_code else None
    return AmpRun(s.mode.name, s.device, _tf32_text(s, after), seconds, made, tuple(notes), value,
                  code=code, extras=instruments.reports(probes),
                  why=where.why if where is not None else "")
