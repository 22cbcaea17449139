"""The code ampnb hands out for a mode, written from the mode's own attributes.

One place for torch's AMP recipe as code (the model and input casts of true modes, the
GradScaler, the step: autocast around forward and loss only, then backward, unscale_, clip,
step, update outside it) and for the mode's Lightning / Accelerate spelling. `--show-code`,
the doctor's take-home code and the distributed scripts all write through it. Pure core.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ampnb import legacy
from ampnb.modes import PrecisionMode, TransformerEngine

# Accelerate's `mixed_precision` names autocast dtypes; it has no pure low-precision setting.
ACCELERATE: dict[torch.dtype, str] = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def dtype_code(dtype: torch.dtype) -> str:
    """A dtype as code: torch.bfloat16."""
    return f"torch.{str(dtype).removeprefix('torch.')}"


def cast_dtype(mode: PrecisionMode) -> torch.dtype | None:
    """The dtype a true mode casts the model and its inputs to (None: mixed modes and fp32)."""
    return None if mode.is_mixed or mode.param_dtype == torch.float32 else mode.param_dtype


def lightning_precision(mode: PrecisionMode) -> str:
    """Lightning's `precision=` string for the mode (APEX levels: what replaced them)."""
    if mode.name in legacy.APEX_MODES:
        level = mode.name.removeprefix("apex-")
        return legacy.APEX[level].today.split("=", 1)[1].strip('"')
    return mode.name


def accelerate_precision(mode: PrecisionMode) -> str:
    """Accelerate's `mixed_precision=` string ("no" for true modes: see `accelerate_cast`)."""
    if isinstance(mode, TransformerEngine):
        return "fp8"
    return ACCELERATE.get(mode.autocast_dtype, "no")


def accelerate_cast(mode: PrecisionMode) -> torch.dtype | None:
    """The dtype to cast the model to yourself under Accelerate (a true mode), else None."""
    return None if isinstance(mode, TransformerEngine) else cast_dtype(mode)


def accelerator_call(mode: PrecisionMode) -> tuple[str, str]:
    """`Accelerator(mixed_precision=...)` and what else to do ('' when nothing)."""
    cast = accelerate_cast(mode)
    todo = "" if cast is None else (f"model.to({dtype_code(cast)}) yourself before accelerator."
                                    "prepare: Accelerate has no pure low-precision setting")
    return f'Accelerator(mixed_precision="{accelerate_precision(mode)}")', todo


def tf32_lines(tf32: str | None) -> list[str]:
    """The TF32 switch as code: 'on', 'off', 'emulate' (ampnb's teaching aid) or None (as is)."""
    if tf32 is None:
        return []
    if tf32 == "emulate":
        return ["# --tf32 emulate is an ampnb teaching aid (matmul/conv inputs rounded to TF32).",
                "# On an NVIDIA Ampere+ GPU the real switch is:",
                "# torch.backends.cuda.matmul.allow_tf32 = True; torch.backends.cudnn.allow_tf32 = True",
                ""]
    flag = "True" if tf32 == "on" else "False"
    return [f"torch.backends.cuda.matmul.allow_tf32 = {flag}  # TF32 matmuls (NVIDIA Ampere+ only)",
            f"torch.backends.cudnn.allow_tf32 = {flag}  # TF32 convolutions",
            ""]


def model_lines(mode: PrecisionMode, model: str = "model") -> list[str]:
    """A true mode's model cast (parameters, gradients, optimizer state in one dtype)."""
    cast = cast_dtype(mode)
    lines = []
    if isinstance(mode, TransformerEngine):
        lines.append("# FP8: Transformer Engine's layers (te.Linear, te.LayerNorm) and "
                     "te.fp8_autocast() around the forward; Lightning swaps and enters them for you")
    if cast is not None:
        lines.append(f"{model} = {model}.to({dtype_code(cast)})  # {mode.name}: parameters, "
                     "gradients and optimizer state in one dtype")
    return lines


def scaler_lines(mode: PrecisionMode, device_type: str, note: str = "") -> list[str]:
    """The GradScaler, made once next to the optimizer, for modes that use one.

    `device_type` is an expression: '"cuda"' or 'device.type'.
    """
    if not mode.uses_scaler:
        return []
    return [f"scaler = torch.amp.GradScaler({device_type})" + (f"  # {note}" if note else "")]


def autocast_call(device_type: str, dtype: torch.dtype | None = None, **flags: bool) -> str:
    """`torch.autocast(device_type=..., dtype=...)` as code; flags such as enabled=False."""
    parts = [f"device_type={device_type}"] + ([f"dtype={dtype_code(dtype)}"] if dtype else [])
    return f"torch.autocast({', '.join(parts + [f'{k}={v}' for k, v in flags.items()])})"


@dataclass(frozen=True)
class Loop:
    """How a caller's training loop names things, and its comments per stage.

    `device_type` is an expression (as in scaler_lines); `to_device`, an expression too, moves
    the inputs and targets first. `notes` keys: loop, inputs, forward, backward, scaler.step,
    optimizer.step.
    """

    device_type: str = '"cuda"'
    inputs: str = "inputs"
    targets: str = "targets"
    to_device: str | None = None
    notes: Mapping[str, str] = field(default_factory=dict)
    clip: float | None = None  # max_norm; None shows where clipping goes, as a comment


def _noted(line: str, note: str | None) -> str:
    return f"{line}  # {note}" if note else line


def step_lines(mode: PrecisionMode, loop: Loop = Loop(), *, autocast: bool = True) -> list[str]:
    """torch's AMP recipe for one step per batch: autocast around forward and loss only;
    backward, unscale_, clip, step, update and zero_grad outside it.

    `autocast=False` leaves autocast out (FSDP2's MixedPrecisionPolicy casts parameters itself).
    """
    x, y, notes = loop.inputs, loop.targets, loop.notes
    cast = cast_dtype(mode)
    lines = [_noted(f"for {x}, {y} in loader:", notes.get("loop"))]
    to = ", ".join(filter(None, (loop.to_device, cast and dtype_code(cast))))
    if to:
        moved = f"{x}, {y} = {x}.to({to}), {y}.to({loop.to_device})" if loop.to_device \
            else f"{x} = {x}.to({to})"
        lines.append(_noted(f"    {moved}",
                            notes.get("inputs", "inputs in the parameters' dtype" if cast else "")))
    forward = f"loss = loss_fn(model({x}), {y})"
    if mode.is_mixed and autocast:
        lines += [_noted(f"    with {autocast_call(loop.device_type, mode.autocast_dtype)}:",
                         notes.get("forward", "forward and loss only")),
                  f"        {forward}"]
    else:
        lines.append(_noted(f"    {forward}", notes.get("forward")))
    clip = f"torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm={loop.clip or 1.0})"
    clip = f"    {clip}" if loop.clip else f"    # {clip}  # to clip"
    outside = "outside autocast" if mode.is_mixed and autocast else ""
    if mode.uses_scaler:
        lines += [_noted("    scaler.scale(loss).backward()", notes.get("backward", outside)),
                  "    scaler.unscale_(optimizer)  # the gradients' true size: clip them here",
                  clip,
                  _noted("    scaler.step(optimizer)",
                         notes.get("scaler.step", "skipped when a gradient is inf/NaN")),
                  "    scaler.update()"]
    else:
        lines += [_noted("    loss.backward()", notes.get("backward", outside)), clip,
                  _noted("    optimizer.step()", notes.get("optimizer.step"))]
    return lines + ["    optimizer.zero_grad()"]


def recipe(mode: PrecisionMode, loop: Loop = Loop()) -> list[str]:
    """The whole recipe: model cast, GradScaler, and the step loop."""
    head = [*model_lines(mode), *scaler_lines(mode, loop.device_type)]
    return [*head, *([""] if head else []), *step_lines(mode, loop)]

