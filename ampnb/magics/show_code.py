"""`--show-code`: the plain torch.amp code for what `%%amp` ran, and the same in Lightning / Accelerate."""

from __future__ import annotations

import textwrap
from typing import Any

import torch

from ampnb import legacy
from ampnb.modes import PrecisionMode

# Lightning's precision strings are ampnb's mode names. Accelerate's `mixed_precision` has
# no "true" half modes: None means "no" plus casting the model yourself.
ACCELERATE: dict[str, str | None] = {
    "32-true": "no",
    "16-mixed": "fp16",
    "bf16-mixed": "bf16",
    "16-true": None,
    "bf16-true": None,
    "64-true": None,
    "transformer-engine": "fp8",
    "transformer-engine-float16": "fp8",
}


def _dt(dtype: torch.dtype) -> str:
    return f"torch.{str(dtype).removeprefix('torch.')}"


def _tf32_lines(tf32: str | None) -> list[str]:
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


def _body(mode: PrecisionMode, device_type: str, cell: str) -> list[str]:
    code = textwrap.indent(cell.strip() or "pass", "    ").splitlines()
    if mode.autocast_dtype is not None:
        lines = []
        if mode.uses_scaler:
            lines += [f'scaler = torch.amp.GradScaler("{device_type}")  # once, next to the optimizer']
        lines += [f'with torch.autocast(device_type="{device_type}", dtype={_dt(mode.autocast_dtype)}):',
                  *code]
        if mode.uses_scaler:
            lines += ["# training step: scaler.scale(loss).backward(); scaler.unscale_(optimizer)",
                      "# before clipping; scaler.step(optimizer); scaler.update()"]
        else:
            lines += ["# training step: loss.backward() and optimizer.step() as usual, outside"
                      " autocast; no GradScaler"]
        return lines
    if mode.param_dtype == torch.float32:
        return ["# nothing to add: fp32 is PyTorch's default", cell.strip()]
    dt = _dt(mode.param_dtype)
    return [f"# tensors and modules created while the default dtype is {dt} are born in it;",
            f"# existing ones keep their dtype: convert them with model.to({dt}), x.to({dt})",
            "previous = torch.get_default_dtype()",
            f"torch.set_default_dtype({dt})",
            "try:", *code,
            "finally:", "    torch.set_default_dtype(previous)"]


def show_code(mode: PrecisionMode, device: str | torch.device, tf32: str | None, cell: str,
              spelled: Any = None) -> str:
    """Plain PyTorch equivalent of running `cell` under mode/device/tf32, plus framework settings.

    `spelled` is the mode as the user wrote it: an older Lightning spelling is explained.
    """
    device_type = torch.device(device).type
    lines = ["import torch", "", *legacy.code_notes(spelled, mode.name), *_tf32_lines(tf32),
             *(legacy.apex_body(mode.name, cell) or _body(mode, device_type, cell)), ""]
    if mode.name in legacy.APEX_MODES:
        return "\n".join(lines + legacy.apex_code(mode.name))
    lines.append(f'# Lightning:  L.Fabric(precision="{mode.name}")  or  L.Trainer(precision="{mode.name}")')
    accelerate = ACCELERATE.get(mode.name)
    if accelerate is None:
        lines.append(f'# Accelerate: Accelerator(mixed_precision="no") and model.to({_dt(mode.param_dtype)})'
                     " yourself: it has no pure low-precision setting")
    else:
        lines.append(f'# Accelerate: Accelerator(mixed_precision="{accelerate}")')
    return "\n".join(lines)
