"""What each stage of the canonical AMP loop does to the model, optimizer and scaler.

A runner gets the step's `Parts` and `StepState` (`ampnb.scaler.state`), does its stage with the
Precision's own pieces (`ampnb.step.forward_loss`, its `backward`; the stepper runs every stage
inside `ampnb.step.step_context`), leaves what the next stage needs in the state, and returns
the fields of its `StageRecord`. `ScalerStepper.next_stage()` calls it with SIGINT held back,
so that a stage either happens and is recorded or does not happen. Only the forward's work
before it commits anything (`prepare_forward`) runs interruptible: it changes nothing kept.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ampnb._tree import tensors
from ampnb.batch import Batch, as_batch
from ampnb.display import dtype_name
from ampnb.scaler.records import StepRecord, flat_grads, grad_stats, measure
from ampnb.scaler.state import Parts, StepState
from ampnb.step import forward_loss

# What the listing and the records say where a stage does not act (one text for both).
NO_SCALER_STEP = "optimizer.step() runs: no inf/NaN check without a GradScaler"
NO_SCALER = "scaler disabled: returns at once"
NO_SCALER_BACKWARD = "scaler disabled: scale() returns the loss as it is; plain backward"
NO_CLIP = "clip_norm off: not called"
INJECT = {"inf": float("inf"), "nan": float("nan")}

Fields = dict[str, Any]  # a runner's StageRecord fields: loss, grads, found_inf, skipped, note


def _norm(stats: Any) -> float:
    return float("nan") if stats is None else stats.norm


def loss_access(output: Any) -> str:
    """How the listing reads the model's own loss from this output: '.loss', "['loss']" or ''."""
    if isinstance(output, torch.Tensor):
        return ""
    if isinstance(getattr(output, "loss", None), torch.Tensor):
        return ".loss"
    return "['loss']" if isinstance(output, Mapping) else ".loss"


class _Placed(Batch):
    """A batch already on the device: `to()` has nothing to move (a move walks and rebuilds
    every container, at every micro-step)."""

    def to(self, device: str | torch.device) -> Batch:
        return self


def _batch(p: Parts, raw: Any) -> Batch:
    """raw as a Batch; one found on the device is kept as placed (the cycle keeps raw alive,
    so its id stays its own)."""
    found = p.placed.get(id(raw))
    if found is not None:
        return found
    batch = as_batch(raw, p.loss_fn)
    if id(raw) not in p.placed:
        on = all(t.device == p.device for t in tensors((batch.args, batch.kwargs, batch.targets)))
        p.placed[id(raw)] = _Placed(batch.args, batch.kwargs, batch.targets) if on else None
    return batch


def prepare_forward(p: Parts, s: StepState) -> tuple[Any, torch.Tensor]:
    """The forward and the loss of the next batch; interruptible (nothing kept is changed)."""
    batch = _batch(p, p.batches[s.batch_index])
    return forward_loss(p.precision, p.model, batch, p.loss_fn)


def forward(p: Parts, s: StepState, prepared: tuple[Any, torch.Tensor]) -> Fields:
    outputs, loss = prepared
    value = loss.item()
    out = outputs if isinstance(outputs, torch.Tensor) else next(
        (t for t in tensors(outputs) if t.is_floating_point()), None)
    s.loss = loss
    s.batch_index += 1
    s.losses.append(value)
    if p.loss_fn is None:
        s.loss_access = loss_access(outputs)
    return dict(loss=value, note=f"outputs {dtype_name(None if out is None else out.dtype)}, "
                                 f"loss {dtype_name(loss.dtype)}")


def divide(p: Parts, s: StepState, _: Any = None) -> Fields:
    s.loss = s.loss / p.settings.accumulation_steps
    return dict(loss=s.loss.item(),
                note=f"divided by accumulation_steps={p.settings.accumulation_steps}")


def _inject(p: Parts, kind: str, layer: str | None) -> tuple[str, int]:
    """Fill the chosen gradients with inf or NaN; the record's text and how many values."""
    target = p.model if layer is None else p.model.get_submodule(layer)
    count = 0
    with torch.no_grad():
        for param in target.parameters(recurse=layer is None):
            if param.grad is not None:
                param.grad.fill_(INJECT[kind])
                count += param.grad.numel()
    return f"{kind} in {layer or 'all'}", count


def backward(p: Parts, s: StepState, _: Any = None) -> Fields:
    loss, s.loss = s.loss, None
    # The Precision's hook: scaler.scale(loss).backward() with the stepper's scaler, or the
    # plain backward without loss scaling; it returns what backward took, read back with the
    # gradient statistics.
    scaled = p.precision.backward(loss).detach()
    note = ("gradients are scaled (x scale) and summed over micro-steps" if p.enabled
            else NO_SCALER_BACKWARD)
    if s.injection is not None:
        (kind, layer), s.injection = s.injection, None
        s.injected, count = _inject(p, kind, layer)
        note = f"injected {s.injected} ({count} gradient values); " + note
    s.scaled_grads = flat_grads(p.params)  # after the last micro-step: the scaled gradients
    # The scaled loss is read back with the gradient statistics (one transfer from a GPU).
    s.scaled, (value,) = measure(s.scaled_grads, flags=[scaled])
    return dict(loss=value, grads=s.scaled, note=note)


def unscale(p: Parts, s: StepState, _: Any = None) -> Fields:
    p.scaler.unscale_(p.optimizer)
    # Disabled, unscale_ returns at once: the gradients are those the last backward left.
    unscaled = flat_grads(p.params) if p.enabled else s.scaled_grads
    # Kept for the before/after-scaling histogram; one copy each, replaced every step.
    s.last_grads = {"scaled": s.scaled_grads, "unscaled": unscaled, "scale": s.scale}
    # The scaler's found_inf flags are read back with the statistics: one sync, not two.
    flags = list(p.scaler._found_inf_per_device(p.optimizer).values()) if p.enabled else []
    s.unscaled, found = measure(unscaled, smallest=True, flags=flags)
    # With no scaler to ask, look at the gradients ourselves.
    s.found_inf = bool(sum(found)) if p.enabled else bool(s.unscaled and s.unscaled.nonfinite)
    note = "divided by the scale; checked for inf/NaN" if p.enabled else NO_SCALER
    return dict(grads=s.unscaled, found_inf=s.found_inf, note=note)


def clip(p: Parts, s: StepState, _: Any = None) -> Fields:
    before, limit = s.unscaled, p.settings.clip_norm
    if not p.settings.clipping:
        s.clipped, s.changed = before, False
        return dict(grads=before, note=NO_CLIP)
    torch.nn.utils.clip_grad_norm_(p.params, limit)
    # Far below the limit torch multiplies by exactly 1.0, which changes no bit: nothing to
    # measure again. Near or above it (or non-finite), measure what clipping left.
    far_below = before is not None and before.norm < 0.5 * limit
    s.clipped = before if far_below else grad_stats(p.params)
    # Non-finite gradients come out NaN from clipping; "changed" only means a finite rescale.
    s.changed = bool(before and s.clipped and math.isfinite(before.norm)
                     and s.clipped.norm != before.norm)
    return dict(grads=s.clipped,
                note=f"clip to {limit}: " + ("changed" if s.changed else "unchanged"))


def _nonfinite_weights(params: list[torch.Tensor]) -> int:
    return int(sum((~torch.isfinite(param.detach())).sum().item() for param in params))


def step(p: Parts, s: StepState, _: Any = None) -> Fields:
    applied: list[bool] = []
    # Observe rather than re-derive: the hook fires only when optimizer.step() really runs.
    handle = p.optimizer.register_step_post_hook(lambda *_: applied.append(True))
    try:
        p.scaler.step(p.optimizer)
    finally:
        handle.remove()
    s.skipped = skipped = not applied
    # Counted only after a step whose gradients held inf/NaN: the rare case worth a pass.
    s.nonfinite_weights = bad = _nonfinite_weights(p.params) if s.found_inf else 0
    if skipped:
        note = "optimizer.step() skipped: inf/NaN found"
    elif not p.enabled:
        note = NO_SCALER_STEP.replace("runs", "ran") + (
            f"; non-finite gradients reached the weights ({bad} values inf/NaN)"
            if s.found_inf else "")
    else:
        note = "optimizer.step() applied"
    return dict(found_inf=s.found_inf, skipped=skipped, note=note)


def update(p: Parts, s: StepState, _: Any = None) -> Fields:
    old = s.scale_now
    p.scaler.update()
    new = s.scale_now = float(p.scaler.get_scale())
    tracker = int(p.scaler._get_growth_tracker())  # one read; state_dict() makes two
    change = "backoff" if new < old else "growth" if new > old else "unchanged"
    s.finished = StepRecord(
        step=s.step, losses=tuple(s.losses), scale=s.scale, new_scale=new,
        growth_tracker=tracker, found_inf=s.found_inf, skipped=s.skipped,
        grad_norm_scaled=_norm(s.scaled), grad_norm_unscaled=_norm(s.unscaled),
        grad_norm_clipped=_norm(s.clipped), clipped=s.changed, injected=s.injected,
        nonfinite_weights=s.nonfinite_weights)
    note = f"scale {change}; growth tracker {tracker}" if p.enabled else NO_SCALER
    return dict(found_inf=s.found_inf, skipped=s.skipped, note=note)


def zero_grad(p: Parts, s: StepState, _: Any = None) -> Fields:
    p.optimizer.zero_grad(set_to_none=True)
    return dict(note="gradients cleared for the next step")
