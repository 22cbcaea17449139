"""The one table of the canonical AMP loop's stages: the plan, the runners and the listing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ampnb.scaler import runners as r
from ampnb.scaler.state import Parts, StepState


@dataclass(frozen=True)
class Loop:
    """What the listing's lines depend on: this run's mode, settings and form of batch."""

    device: str
    autocast: torch.dtype | None
    mode: str
    accumulation_steps: int
    clip_norm: float | None
    enabled: bool
    fetch: str  # how a micro-step reads its batch, e.g. "x, y = next(batches)"
    call: str   # how it computes the loss, e.g. "loss = model(**batch).loss"


def _forward_code(loop: Loop) -> tuple[str, ...]:
    context = (f"with torch.autocast({loop.device!r}, dtype={loop.autocast}):" if loop.autocast
               else f"with nullcontext():  # {loop.mode}: no autocast")
    return context, "    " + loop.call


def _when_enabled(code: str, enabled: str,
                  disabled: str = r.NO_SCALER) -> Callable[[Loop], tuple[str, ...]]:
    return lambda loop: (f"{code}  # {enabled if loop.enabled else disabled}",)


def _step_code(loop: Loop) -> tuple[str, ...]:
    # A disabled GradScaler's step() is `return optimizer.step()`: no check, no skip.
    return (f"scaler.step(optimizer)  # "
            f"{'skipped if found_inf' if loop.enabled else r.NO_SCALER_STEP}",)


def _clip_code(loop: Loop) -> tuple[str, ...]:
    return (f"clip_grad_norm_(model.parameters(), {loop.clip_norm})"
            + ("" if loop.clip_norm else f"  # {r.NO_CLIP}"),)


@dataclass(frozen=True)
class Stage:
    """One stage: its name, the code it shows, what runs it, and when it runs."""

    name: str
    micro: bool  # once per micro-step (True), or once at the accumulation boundary
    code: Callable[[Loop], tuple[str, ...]]  # the listing's lines for this run's settings
    run: Callable[[Parts, StepState, Any], r.Fields]  # does the stage (SIGINT held back)
    # Work before the stage commits anything, so an interrupt there leaves it not done.
    prepare: Callable[[Parts, StepState], Any] | None = None


# nanoGPT's order (docs/design.md, conventions). Where a stage does not act (scaler disabled, clip_norm off) it
# still has its place: the listing says so, and its record says what happened instead.
STAGES: tuple[Stage, ...] = (
    Stage("forward", True, _forward_code, r.forward, r.prepare_forward),
    Stage("divide", True, lambda loop: (f"loss = loss / {loop.accumulation_steps}",), r.divide),
    Stage("backward", True, _when_enabled("scaler.scale(loss).backward()",
                                          "gradients x scale, summed", r.NO_SCALER_BACKWARD),
          r.backward),
    Stage("unscale", False, _when_enabled("scaler.unscale_(optimizer)",
                                          "divides by the scale, checks inf/NaN"), r.unscale),
    Stage("clip", False, _clip_code, r.clip),
    Stage("step", False, _step_code, r.step),
    Stage("update", False, _when_enabled("scaler.update()", "backoff or growth"), r.update),
    Stage("zero_grad", False, lambda loop: ("optimizer.zero_grad(set_to_none=True)",),
          r.zero_grad),
)
STAGE_BY_NAME = {s.name: s for s in STAGES}
MICRO = tuple(s for s in STAGES if s.micro)
BOUNDARY = tuple(s for s in STAGES if not s.micro)


def plan(accumulation_steps: int) -> tuple[Stage, ...]:
    """The stages of one optimizer step: the micro-stages per micro-step, then the boundary."""
    return MICRO * accumulation_steps + BOUNDARY


def listing(loop: Loop) -> list[tuple[str | None, str]]:
    """The loop's code, one (stage name or None, line) per line."""
    lines: list[tuple[str | None, str]] = [
        (None, f"for micro_step in range({loop.accumulation_steps}):"), (None, "    " + loop.fetch)]
    lines += [(s.name, "    " + line) for s in MICRO for line in s.code(loop)]
    lines += [(s.name, line) for s in BOUNDARY for line in s.code(loop)]
    return lines


def call_text(batch: Any, loss_fn: Any, access: str = ".loss") -> tuple[str, str]:
    """(fetch, call) lines matching how a batch (an `ampnb.batch.Batch`) calls the model."""
    star = "**" if batch.kwargs else "" if len(batch.args) == 1 else "*"
    if loss_fn is not None:
        return "x, y = next(batches)", f"loss = loss_fn(model({star}x), y)"
    return "batch = next(batches)", f"loss = model({star}batch){access}"
