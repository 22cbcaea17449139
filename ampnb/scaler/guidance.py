"""Plain-words guidance for the classic GradScaler mistakes, beside torch's own message."""

from __future__ import annotations

import functools
import html
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ampnb.putback import rng_kept
from ampnb.scaler import cases
from ampnb.scaler.records import format_scale

_SILENT = "(torch says nothing: no error, no warning)"


@dataclass(frozen=True)
class Guidance:
    """One mistake: torch's own words, what really happened (with measured figures), the fix."""

    case: str
    title: str
    torch_says: str
    plain_words: str
    fix: str

    def __repr__(self) -> str:
        return "\n".join([f"[{self.case}] {self.title}", f"torch says: {self.torch_says or _SILENT}",
                          f"in plain words: {self.plain_words}", f"fix: {self.fix}"])

    __str__ = __repr__

    def _repr_html_(self) -> str:
        e = html.escape
        return (f'<div class="ampnb-guidance"><b>{e(self.title)}</b>'
                f"<p><i>torch says:</i> <code>{e(self.torch_says or _SILENT)}</code></p>"
                f"<p><i>in plain words:</i> {e(self.plain_words)}</p>"
                f"<p><i>fix:</i> {e(self.fix)}</p></div>")


@dataclass(frozen=True)
class Case:
    """How to reproduce a mistake, how to recognise torch's message, and what to say."""

    title: str
    demo: Callable[[], tuple[str, dict]]
    words: str   # formatted with the figures the demo measured
    fix: str
    match: str = ""  # a piece of torch's message that identifies this case


GUIDANCE: dict[str, Case] = {
    "unscale_twice": Case(
        "unscale_() called twice before update()", cases.unscale_twice,
        "unscale_() divides the gradients by the scale ({scale}) in place and remembers that it "
        "did. A second call would divide again and leave gradients {scale} times too small, so "
        "torch refuses.",
        "call scaler.unscale_(optimizer) once per optimizer step: after the last micro-step's "
        "backward, before clipping; scaler.step() then knows it was done.",
        "unscale_() has already been called"),
    "clip_scaled": Case(
        "clipping the scaled gradients", cases.clip_scaled,
        "Before unscale_ the gradients are multiplied by the scale {scale}: their norm is "
        "{scaled} instead of {true}. Clipping them to {clip} and unscaling afterwards leaves a "
        "norm of {wrong}, {ratio} times smaller than the {right} you meant, so every update "
        "shrinks and training stalls without any error.",
        "scaler.unscale_(optimizer) first, then clip_grad_norm_, then scaler.step(optimizer)."),
    "update_without_step": Case(
        "scaler.update() without scaler.step()", cases.update_without_step,
        "update() decides between backoff and growth from the inf/NaN checks that unscale_() or "
        "step() record; with neither there is nothing to decide from. After unscale_() alone "
        "torch accepts update(): the growth tracker counted a clean step ({tracker}) although "
        "the parameters never moved (unchanged: {unchanged}).",
        "end every optimizer step with scaler.step(optimizer) and then scaler.update().",
        "No inf checks were recorded prior to update"),
    "scheduler_before_step": Case(
        "lr_scheduler.step() warning after a skipped first step", cases.scheduler_before_step,
        "The first step ran at scale {scale}; its gradients held inf/NaN (found_inf "
        "{found_inf}), so scaler.step() skipped optimizer.step() and the scheduler, which only "
        "counts real optimizer steps, warned. The scale backed off to {new}. This is expected "
        "while the scale calibrates in the first steps; your call order is right.",
        "nothing to fix if the order is step, update, scheduler.step(); the warning fades once "
        "steps stop being skipped (a smaller init_scale avoids it).",
        "before `optimizer.step()`"),
    "scale_collapse": Case(
        "the scale collapses towards 0", cases.scale_collapse,
        "{skipped} of {steps} steps overflowed, so the scale was cut at every update: from "
        "{first} to {final}. Below 1, scaling makes gradients smaller, not larger. The largest "
        "weight is |w| = {wmax}; fp16's largest value is {fp16_max} while bf16 reaches "
        "{bf16_max}. Any weight, input or activation beyond fp16's range (common in models "
        "trained in bf16) overflows in the fp16 forward pass, and no loss scale can fix an "
        "overflow in the forward pass.",
        "use bf16-mixed (no scaler needed), or keep the overflowing layers in fp32, or find the "
        "first op that overflows (ampnb.find_nonfinite)."),
    "bf16_no_scaler": Case(
        "bf16-mixed needs no GradScaler", cases.bf16_no_scaler,
        "Loss scaling exists because fp16 gradients underflow: fp16's smallest normal is "
        "{fp16_min} (subnormals stop at {fp16_sub}) and its largest value {fp16_max}. bf16 keeps "
        "fp32's {bf16_exp} exponent bits: smallest normal {bf16_min} (fp32: {fp32_min}), largest "
        "{bf16_max}. Small gradients stay representable, so the scaler would only add work.",
        "with bf16-mixed, leave the scaler out (Lightning forbids one); the stepper runs with "
        "GradScaler(enabled=False)."),
    "fp16_grads": Case(
        "unscaling fp16 gradients (16-true)", cases.fp16_grads,
        "In 16-true the parameters, and so their gradients, are fp16; unscaling would divide "
        "them in fp16 and flush the small values the scale was protecting back to zero, so "
        "torch refuses. Updates also vanish: fp16's eps is {eps}, and a "
        "weight of 1.0 minus an update of {update} stays 1.0 in fp16 (lost: {lost}) but not in "
        "fp32 (kept: {fp32_kept}). This is why APEX O2 kept fp32 master weights: the fp16 "
        "model computes, gradients are copied to an fp32 master copy, unscaled and stepped "
        "there, then copied back. 16-mixed gets the same effect by keeping parameters fp32 "
        "and casting per op under autocast.",
        "use 16-mixed (fp32 parameters + autocast + GradScaler), or bf16-true without a scaler.",
        "Attempting to unscale FP16 gradients"),
}


def explain(case: str) -> Guidance:
    """Reproduce `case` on a tiny real model and explain it beside torch's own message."""
    if case not in GUIDANCE:
        raise ValueError(f"case={case!r} is not known; allowed: {', '.join(GUIDANCE)}.")
    return _explain(case)


@functools.cache
def _explain(case: str) -> Guidance:
    # The demos are deterministic, so one run per session is enough (the panel asks often);
    # rng_kept keeps the tiny models' initialisation out of the user's random streams.
    c = GUIDANCE[case]
    with rng_kept():
        torch_says, figures = c.demo()
    return Guidance(case, c.title, torch_says, c.words.format(**figures), c.fix)


def explain_error(error: BaseException | str) -> Guidance | None:
    """Guidance for an error or warning raised by your own loop (None if it is not a known one)."""
    message = str(error)
    for name, c in GUIDANCE.items():
        if c.match and c.match in message:
            found = explain(name)
            return Guidance(name, c.title, message, found.plain_words, c.fix)
    return None


def diagnose(stepper: Any) -> list[Guidance]:
    """The cases a stepper's own run shows: no scaler needed, skipped first step, collapse."""
    found: list[Guidance] = []
    if not stepper.enabled:
        case = _why_no_scaler(stepper.mode)
        if case:
            found.append(explain(case))
    history = stepper.history
    if history and history[0].skipped:
        # This run's own figures, not the demo's: the panel shows it next to this run.
        c, first = GUIDANCE["scheduler_before_step"], history[0]
        figures = {"scale": format_scale(first.scale), "found_inf": first.found_inf,
                   "new": format_scale(first.new_scale)}
        found.append(Guidance("scheduler_before_step", c.title,
                              explain("scheduler_before_step").torch_says,
                              c.words.format(**figures), c.fix))
    # Below 1 the scale shrinks gradients; 5 skips in a row is far past the few skips of
    # calibration at the start of training (each skip already divides the scale by 2).
    if history and (history[-1].new_scale < 1 or _skips_in_a_row(history) >= 5):
        c = GUIDANCE["scale_collapse"]
        wmax = max(p.detach().abs().max().item() for p in stepper.model.parameters())
        figures = {**cases.format_ranges(), "steps": len(history), "wmax": f"{wmax:.3g}",
                   "skipped": sum(r.skipped for r in history),
                   "first": f"{history[0].scale:g}", "final": f"{history[-1].new_scale:g}"}
        found.append(Guidance("scale_collapse", c.title, "", c.words.format(**figures), c.fix))
    return found


# Why a mode runs without a scaler, by where its 16-bit dtype lives. fp32/fp64 modes need
# no explanation, and 16-mixed with the scaler switched off was the user's own choice.
_NO_SCALER_CASE = {("param", torch.float16): "fp16_grads",
                   ("param", torch.bfloat16): "bf16_no_scaler",
                   ("autocast", torch.bfloat16): "bf16_no_scaler"}


def _why_no_scaler(mode: Any) -> str | None:
    keys = (("param", getattr(mode, "param_dtype", None)),
            ("autocast", getattr(mode, "autocast_dtype", None)))
    return next((_NO_SCALER_CASE[k] for k in keys if k in _NO_SCALER_CASE), None)


def _skips_in_a_row(history: list) -> int:
    run = 0
    for r in reversed(history):
        if not r.skipped:
            break
        run += 1
    return run
