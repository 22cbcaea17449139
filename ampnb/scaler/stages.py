"""The eight stages of the canonical AMP loop, each a small function that runs it and records it."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ampnb.scaler.records import (
    STAGE_BY_NAME,
    StageRecord,
    StepRecord,
    flat_grads,
    grad_stats,
    measure,
)

if TYPE_CHECKING:
    from ampnb.scaler.stepper import ScalerStepper


def _record(s: ScalerStepper, stage: str, **kw: Any) -> StageRecord:
    micro = s.micro_step if STAGE_BY_NAME[stage].micro else None
    # The scale only changes in update(): a cached copy spares a device sync per stage.
    return StageRecord(s.step_index, micro, stage, s._scale_now, **kw)


def _to(data: Any, device: torch.device) -> Any:
    if isinstance(data, torch.Tensor):  # a device check is cheaper than a no-op .to()
        return data if data.device == device else data.to(device)
    if isinstance(data, (list, tuple)):
        return type(data)(_to(d, device) for d in data)
    return data


def _norm(stats: Any) -> float:
    return float("nan") if stats is None else stats.norm


def forward(s: ScalerStepper) -> StageRecord:
    inputs, targets = s.batch(s.batch_index)
    inputs = s.mode.convert_input(_to(inputs, s.device))
    targets = _to(targets, s.device)
    with s.mode.forward_context(s.device):
        outputs = s.model(inputs)
        s._loss = s.loss_fn(outputs, targets)
    s.batch_index += 1
    loss = s._loss.item()
    s._losses.append(loss)
    return _record(s, "forward", loss=loss,
                   note=f"outputs {getattr(outputs, 'dtype', '?')}, loss {s._loss.dtype}")


def divide(s: ScalerStepper) -> StageRecord:
    s._loss = s._loss / s.settings.accumulation_steps
    return _record(s, "divide", loss=s._loss.item(),
                   note=f"divided by accumulation_steps={s.settings.accumulation_steps}")


def backward(s: ScalerStepper) -> StageRecord:
    scaled = s.scaler.scale(s._loss)
    scaled.backward()
    s._loss = None
    note = ("gradients are scaled (x scale) and summed over micro-steps" if s.enabled
            else "scaler disabled: plain backward")
    if s._injection is not None:
        s._notes["injected"] = s._apply_injection()
        note = f"injected {s._notes['injected']}; " + note
    s._flat = flat_grads(s.params)  # after the last micro-step: the scaled gradients
    # The scaled loss is read back with the gradient statistics (one transfer from a GPU).
    grads, (loss,) = measure(s._flat, flags=[scaled])
    return _record(s, "backward", loss=loss, grads=grads, note=note)


def unscale(s: ScalerStepper) -> StageRecord:
    s.scaler.unscale_(s.optimizer)
    unscaled = flat_grads(s.params)
    # Kept for the before/after-scaling histogram; one copy each, replaced every step.
    s.last_grads = {"scaled": s._flat, "unscaled": unscaled, "scale": s._step_scale}
    # The scaler's found_inf flags are read back with the statistics: one sync, not two.
    flags = list(s.scaler._found_inf_per_device(s.optimizer).values()) if s.enabled else []
    after, found = measure(unscaled, smallest=True, flags=flags)
    # The scaled statistics are those the last backward recorded (nothing ran in between).
    before = s.stages[-1].grads
    # With no scaler to ask, look at the gradients ourselves.
    found_inf = bool(sum(found)) if s.enabled else bool(after and after.nonfinite)
    s._notes.update(before=before, after=after, found_inf=found_inf)
    note = "divided by the scale; checked for inf/NaN" if s.enabled else "scaler disabled: no-op"
    return _record(s, "unscale", grads=after, found_inf=found_inf, note=note)


def clip(s: ScalerStepper) -> StageRecord:
    before = s._notes["after"]
    if not s.settings.clipping:
        s._notes.update(clipped=before, changed=False)
        return _record(s, "clip", grads=before, note="clip_norm off")
    torch.nn.utils.clip_grad_norm_(s.params, s.settings.clip_norm)
    # Far below the limit torch multiplies by exactly 1.0, which changes no bit: nothing to
    # measure again. Near or above it (or non-finite), measure what clipping left.
    far_below = before is not None and before.norm < 0.5 * s.settings.clip_norm
    clipped = before if far_below else grad_stats(s.params)
    # Non-finite gradients come out NaN from clipping; "changed" only means a finite rescale.
    changed = bool(before and clipped and math.isfinite(before.norm)
                   and clipped.norm != before.norm)
    s._notes.update(clipped=clipped, changed=changed)
    return _record(s, "clip", grads=clipped, note=f"clip to {s.settings.clip_norm}: "
                   + ("changed" if changed else "unchanged"))


def step(s: ScalerStepper) -> StageRecord:
    applied: list[bool] = []
    # Observe rather than re-derive: the hook fires only when optimizer.step() really runs.
    handle = s.optimizer.register_step_post_hook(lambda *_: applied.append(True))
    try:
        s.scaler.step(s.optimizer)
    finally:
        handle.remove()
    s._notes["skipped"] = skipped = not applied
    note = "optimizer.step() skipped: inf/NaN found" if skipped else "optimizer.step() applied"
    return _record(s, "step", found_inf=s._notes["found_inf"], skipped=skipped, note=note)


def update(s: ScalerStepper) -> StageRecord:
    old = s._scale_now  # a cached copy: only update() changes the scale
    s.scaler.update()
    new = s._scale_now = s.scale
    tracker = s.growth_tracker
    change = "backoff" if new < old else "growth" if new > old else "unchanged"
    n = s._notes
    s.history.append(StepRecord(
        step=s.step_index, losses=tuple(s._losses), scale=s._step_scale, new_scale=new,
        growth_tracker=tracker, found_inf=n["found_inf"], skipped=n["skipped"],
        grad_norm_scaled=_norm(n["before"]), grad_norm_unscaled=_norm(n["after"]),
        grad_norm_clipped=_norm(n["clipped"]), clipped=n["changed"], injected=n["injected"]))
    return _record(s, "update", found_inf=n["found_inf"], skipped=n["skipped"],
                   note=f"scale {change}; growth tracker {tracker}")


def zero_grad(s: ScalerStepper) -> StageRecord:
    s.optimizer.zero_grad(set_to_none=True)
    return _record(s, "zero_grad", note="gradients cleared for the next step")


RUNNERS: dict[str, Callable[[ScalerStepper], StageRecord]] = {
    "forward": forward, "divide": divide, "backward": backward, "unscale": unscale,
    "clip": clip, "step": step, "update": update, "zero_grad": zero_grad,
}
