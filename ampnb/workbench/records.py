"""What one Workbench step leaves behind, and the figures derived from a run of them."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ampnb.display import Table, dtype_name, format_bytes

REFERENCE_MODE = "32-true"


@dataclass(frozen=True)
class StepRecord:
    """One training step: its loss, wall time, memory and the settings it ran under."""

    step: int                  # 0-based index in the Workbench's history
    loss: float                # the loss this step computed (before its update)
    seconds: float             # wall time of the whole step, device synchronised
    mode: str                  # precision mode name, e.g. "bf16-mixed"
    device: str                # e.g. "cpu", "cuda:0"
    tf32: bool                 # TF32 switch during the step (no effect on CPU)
    param_dtype: torch.dtype   # dtype of the parameters that trained
    output_dtype: torch.dtype | None  # dtype the model's forward produced (before convert_output)
    memory: int                # peak bytes saved for backward (MemoryMeter; parameters not counted)
    cuda_peak: int | None      # CUDA peak above the step's start (MemoryMeter); None off CUDA
    skipped: bool              # the GradScaler skipped optimizer.step() (inf/NaN gradients)
    scale: float | None        # loss scale used this step; None without a GradScaler
    first_after_switch: bool   # first step after construction/set()/restore(): one-time costs
    notes: tuple[str, ...] = ()  # what the switches before this step changed irreversibly
    nonfinite: tuple[str, ...] = ()  # parameters this step's update left holding inf/NaN
    kernels: str = ""          # how fp16 products ran ('' when natively; see ampnb.fp16_kernels)
    keep_fp32: tuple[str, ...] = ()  # module paths that ran in fp32


def nonfinite_note(step: int, mode: str, names: tuple[str, ...]) -> str:
    """What a learner reads when a step left inf/NaN in the weights."""
    shown = ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")
    return (f"step {step} ({mode}) left inf/NaN in {len(names)} parameter(s): {shown}; its loss "
            f"was computed before the update, the next step's loss will show it.")


def recent_median(history: Sequence[StepRecord], mode: str, device: str,
                  window: int = 10) -> float | None:
    """Median seconds of the latest `window` steps in `mode` on `device` (warm ones if any)."""
    runs = [r for r in history if r.mode == mode and r.device == device]
    warm = [r for r in runs if not r.first_after_switch]
    chosen = (warm or runs)[-window:]
    return statistics.median(r.seconds for r in chosen) if chosen else None


def speedup(history: Sequence[StepRecord], mode: str, device: str,
            window: int = 10) -> float | None:
    """Measured step-time ratio 32-true / `mode` on this device; None until both exist."""
    ref = recent_median(history, REFERENCE_MODE, device, window)
    cur = recent_median(history, mode, device, window)
    if ref is None or cur is None or cur <= 0:
        return None
    return ref / cur


def history_table(history: Sequence[StepRecord], last: int | None = None, where: str = "") -> Table:
    """The step records as a table; `where`: the device the Workbench started on, and why."""
    rows = [(r.step, r.mode, r.device, "on" if r.tf32 else "off", dtype_name(r.param_dtype),
             f"{r.loss:.6g}", f"{r.seconds * 1e3:.1f} ms", format_bytes(r.memory),
             format_bytes(r.cuda_peak), "yes" if r.skipped else "",
             "-" if r.scale is None else f"{r.scale:g}",
             f"inf/NaN ({len(r.nonfinite)})" if r.nonfinite else "")
            for r in (history[-last:] if last else history)]
    notes = tuple(n for r in history for n in r.notes)
    notes += tuple(dict.fromkeys(f"{r.mode}: {r.kernels}" for r in history if r.kernels))
    notes += tuple(dict.fromkeys(f"{r.mode}: kept in fp32: {', '.join(r.keep_fp32)}"
                                 for r in history if r.keep_fp32))
    return Table(("step", "mode", "device", "tf32", "params", "loss", "time", "saved for backward",
                  "CUDA peak", "skipped", "scale", "weights after"), rows,
                 caption="Workbench steps" + (f", started on {where}" if where else ""), notes=notes)
