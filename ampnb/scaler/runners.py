"""What each stage of the canonical AMP loop does to the model, optimizer and scaler, and records.

A runner is called by `ScalerStepper.next_stage()` with SIGINT held back, so that a stage either
happens and is recorded or does not happen. Only the forward's work before it commits anything
(`prepare_forward`) runs interruptible: it changes nothing the stepper keeps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from ampnb._interrupt import deferred
from ampnb._tree import tensors
from ampnb.batch import as_batch, step_loss
from ampnb.display import dtype_name
from ampnb.scaler.records import StageRecord, StepRecord, flat_grads, grad_stats, measure

if TYPE_CHECKING:
    from ampnb.scaler.stepper import ScalerStepper

# What the listing and the records say where a stage does not act (one text for both).
NO_SCALER_STEP = "optimizer.step() runs: no inf/NaN check without a GradScaler"
NO_SCALER = "scaler disabled: returns at once"
NO_SCALER_BACKWARD = "scaler disabled: scale() returns the loss as it is; plain backward"
NO_CLIP = "clip_norm off: not called"


def _record(s: ScalerStepper, **kw: Any) -> StageRecord:
    stage = s.current_stage
    micro = s.micro_step if stage.micro else None
    # The scale only changes in update(): a cached copy spares a device sync per stage.
    return StageRecord(s.step_index, micro, stage.name, s._scale_now, **kw)


def _norm(stats: Any) -> float:
    return float("nan") if stats is None else stats.norm


def loss_access(output: Any) -> str:
    """How the listing reads the model's own loss from this output: '.loss', "['loss']" or ''."""
    if isinstance(output, torch.Tensor):
        return ""
    if isinstance(getattr(output, "loss", None), torch.Tensor):
        return ".loss"
    return "['loss']" if isinstance(output, Mapping) else ".loss"


def _within(context: AbstractContextManager, fn: Callable[[], Any]) -> Any:
    """fn() inside a context (e.g. autocast) whose exit an interrupt cannot skip."""
    hold = deferred()
    with context:
        result = fn()
        # An interrupt at the with's closing line would skip its exit: hold it until after.
        hold.__enter__()
    hold.__exit__(None, None, None)
    return result


def prepare_forward(s: ScalerStepper) -> tuple[torch.Tensor, Any]:
    """The forward and the loss of the next batch; interruptible (nothing kept is changed)."""
    raw = s.batch(s.batch_index)
    batch = as_batch(raw, s.loss_fn)
    # A batch seen on the device needs no move (a move or a walk rebuilds every container).
    if id(raw) not in s._on_device:
        if any(t.device != s.device for t in tensors((batch.args, batch.kwargs, batch.targets))):
            batch = batch.to(s.device)
        else:
            s._on_device.add(id(raw))  # the cycle keeps raw alive, so its id stays its own
    batch = batch.convert(s.mode.convert_input)

    def compute() -> tuple[torch.Tensor, Any]:
        outputs = batch.call(s.model)
        return step_loss(outputs, batch, s.loss_fn), outputs

    # fp16 products of the forward run as the mode's kernels do here (emulated on most CPUs)
    return _within(s.mode.kernel_context(s.device),
                   lambda: _within(s.mode.forward_context(s.device), compute))


def forward(s: ScalerStepper, prepared: tuple[torch.Tensor, Any]) -> StageRecord:
    loss_t, outputs = prepared
    value = loss_t.item()
    out = next((t for t in tensors(outputs) if t.is_floating_point()), None)
    s._loss = loss_t
    s.batch_index += 1
    s._losses.append(value)
    if s.loss_fn is None:
        s._loss_access = loss_access(outputs)
    return _record(s, loss=value, note=f"outputs {dtype_name(None if out is None else out.dtype)}, "
                                       f"loss {dtype_name(loss_t.dtype)}")


def divide(s: ScalerStepper, _: Any = None) -> StageRecord:
    s._loss = s._loss / s.settings.accumulation_steps
    return _record(s, loss=s._loss.item(),
                   note=f"divided by accumulation_steps={s.settings.accumulation_steps}")


def backward(s: ScalerStepper, _: Any = None) -> StageRecord:
    scaled = s.scaler.scale(s._loss)
    with s.mode.kernel_context(s.device):  # backward's products as the forward's
        scaled.backward()
    s._loss = None
    note = ("gradients are scaled (x scale) and summed over micro-steps" if s.enabled
            else NO_SCALER_BACKWARD)
    if s._injection is not None:
        s._notes["injected"], count = s._apply_injection()
        note = f"injected {s._notes['injected']} ({count} gradient values); " + note
    s._flat = flat_grads(s.params)  # after the last micro-step: the scaled gradients
    # The scaled loss is read back with the gradient statistics (one transfer from a GPU).
    grads, (loss,) = measure(s._flat, flags=[scaled])
    return _record(s, loss=loss, grads=grads, note=note)


def unscale(s: ScalerStepper, _: Any = None) -> StageRecord:
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
    note = "divided by the scale; checked for inf/NaN" if s.enabled else NO_SCALER
    return _record(s, grads=after, found_inf=found_inf, note=note)


def clip(s: ScalerStepper, _: Any = None) -> StageRecord:
    before = s._notes["after"]
    if not s.settings.clipping:
        s._notes.update(clipped=before, changed=False)
        return _record(s, grads=before, note=NO_CLIP)
    torch.nn.utils.clip_grad_norm_(s.params, s.settings.clip_norm)
    # Far below the limit torch multiplies by exactly 1.0, which changes no bit: nothing to
    # measure again. Near or above it (or non-finite), measure what clipping left.
    far_below = before is not None and before.norm < 0.5 * s.settings.clip_norm
    clipped = before if far_below else grad_stats(s.params)
    # Non-finite gradients come out NaN from clipping; "changed" only means a finite rescale.
    changed = bool(before and clipped and math.isfinite(before.norm)
                   and clipped.norm != before.norm)
    s._notes.update(clipped=clipped, changed=changed)
    return _record(s, grads=clipped, note=f"clip to {s.settings.clip_norm}: "
                   + ("changed" if changed else "unchanged"))


def _nonfinite_weights(params: list[torch.Tensor]) -> int:
    return int(sum((~torch.isfinite(p.detach())).sum().item() for p in params))


def step(s: ScalerStepper, _: Any = None) -> StageRecord:
    applied: list[bool] = []
    # Observe rather than re-derive: the hook fires only when optimizer.step() really runs.
    handle = s.optimizer.register_step_post_hook(lambda *_: applied.append(True))
    try:
        s.scaler.step(s.optimizer)
    finally:
        handle.remove()
    s._notes["skipped"] = skipped = not applied
    found_inf = s._notes["found_inf"]
    # Counted only after a step whose gradients held inf/NaN: the rare case worth a pass.
    s._notes["nonfinite_weights"] = bad = _nonfinite_weights(s.params) if found_inf else 0
    if skipped:
        note = "optimizer.step() skipped: inf/NaN found"
    elif not s.enabled:
        note = NO_SCALER_STEP.replace("runs", "ran") + (
            f"; non-finite gradients reached the weights ({bad} values inf/NaN)" if found_inf else "")
    else:
        note = "optimizer.step() applied"
    return _record(s, found_inf=found_inf, skipped=skipped, note=note)


def update(s: ScalerStepper, _: Any = None) -> StageRecord:
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
        grad_norm_clipped=_norm(n["clipped"]), clipped=n["changed"], injected=n["injected"],
        nonfinite_weights=n["nonfinite_weights"]))
    note = f"scale {change}; growth tracker {tracker}" if s.enabled else NO_SCALER
    return _record(s, found_inf=n["found_inf"], skipped=n["skipped"], note=note)


def zero_grad(s: ScalerStepper, _: Any = None) -> StageRecord:
    s.optimizer.zero_grad(set_to_none=True)
    return _record(s, note="gradients cleared for the next step")
