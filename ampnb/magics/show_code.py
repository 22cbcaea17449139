"""`--show-code`: the plain torch.amp code for what `%%amp` ran, and the same in Lightning / Accelerate."""

from __future__ import annotations

import textwrap
from typing import Any

import torch

from ampnb import legacy
from ampnb import recipe_code as rc
from ampnb.fp16_kernels import Fp16Kernels, emulates_fp16
from ampnb.modes import PrecisionMode
from ampnb.recipe_cell import backward_outside_autocast


def _indented(code: str) -> list[str]:
    return textwrap.indent(code, "    ").splitlines()


def _mixed(mode: PrecisionMode, device_type: str, cell: str) -> list[str]:
    dev = f'"{device_type}"'
    found = backward_outside_autocast(cell, dev)
    code, trains = found or (cell, False)
    lines = []
    if trains:
        lines += ["# the cell as %%amp ran it: under autocast, its backward outside autocast, and no",
                  "# autocast-cached weight copy kept across an optimizer.step() (cache_enabled=False)"]
    elif found is None:
        lines += ["# a backward in this cell runs outside autocast, as %%amp runs it: wrap it in",
                  f"# with {rc.autocast_call(dev, enabled=False)}:"]
    flags = {"cache_enabled": False} if trains else {}
    return lines + [f"with {rc.autocast_call(dev, mode.autocast_dtype, **flags)}:", *_indented(code)]


def _body(mode: PrecisionMode, device_type: str, cell: str) -> list[str]:
    code = cell.strip() or "pass"
    if mode.is_mixed:
        return _mixed(mode, device_type, code)
    if mode.param_dtype == torch.float32:
        return ["# nothing to add: fp32 is PyTorch's default", code]
    dt = rc.dtype_code(mode.param_dtype)
    return [f"# tensors and modules created while the default dtype is {dt} are born in it;",
            f"# existing ones keep their dtype: convert them with model.to({dt}), x.to({dt})",
            "previous = torch.get_default_dtype()",
            f"torch.set_default_dtype({dt})",
            "try:", *_indented(code),
            "finally:", "    torch.set_default_dtype(previous)"]


def _kernels_note(mode: PrecisionMode, device: str | torch.device,
                  fp16_kernels: str | Fp16Kernels | None) -> list[str]:
    if mode.compute_dtype != torch.float16 or not emulates_fp16(device, fp16_kernels):
        return []
    return ["# on this CPU ampnb ran fp16 products as fp32 kernels rounded once to fp16 (what tensor",
            "# cores do); plain torch here runs its own fp16 kernels: slower, their sums may round",
            "# differently (%%amp --fp16-kernels native runs those)",
            ""]


def _recipe(mode: PrecisionMode, device_type: str) -> list[str]:
    """torch's recipe for a training loop in the mode, as comments beside the cell's code."""
    if mode.name == "32-true":
        return []
    loop = rc.recipe(mode, rc.Loop(device_type=f'"{device_type}"'))
    return [f"# A training loop under {mode.name}, as torch's AMP recipe writes it:",
            *(f"#   {line}".rstrip() for line in loop), ""]


def show_code(mode: PrecisionMode, device: str | torch.device, tf32: str | None, cell: str,
              spelled: Any = None, fp16_kernels: str | Fp16Kernels | None = None) -> str:
    """Plain PyTorch equivalent of running `cell` under mode/device/tf32, plus framework settings.

    `spelled` is the mode as the user wrote it: an older Lightning spelling is explained.
    `fp16_kernels` is the run's choice (None: the process-wide one).
    """
    device_type = torch.device(device).type
    lines = ["import torch", "", *legacy.code_notes(spelled, mode.name), *rc.tf32_lines(tf32),
             *_kernels_note(mode, device, fp16_kernels),
             *(legacy.apex_body(mode.name, cell) or _body(mode, device_type, cell)), ""]
    if mode.name in legacy.APEX_MODES:
        return "\n".join(lines + legacy.apex_code(mode.name))
    precision = rc.lightning_precision(mode)
    call, todo = rc.accelerator_call(mode)
    return "\n".join([*lines, *_recipe(mode, device_type),
                      f'# Lightning:  L.Fabric(precision="{precision}")  or  '
                      f'L.Trainer(precision="{precision}")',
                      f"# Accelerate: {call}" + (f"; {todo}" if todo else "")])
