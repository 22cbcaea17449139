"""The details stage: per-layer evidence (instrumented steps), where each broken mode broke, the
fp64 check and profiles, as the budget and the memory cap allow."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ampnb.diagnosis.budget import Clock
from ampnb.diagnosis.candidates import REFERENCE, Candidate
from ampnb.diagnosis.errors import rel
from ampnb.diagnosis.evidence import underflow
from ampnb.diagnosis.headline import Headline
from ampnb.diagnosis.islands_stage import Islands, formats_of, instrumented_cost, reference
from ampnb.diagnosis.layers import LayerRow, layer_rows
from ampnb.diagnosis.memory_cap import MemoryCap
from ampnb.diagnosis.profile import Profile, profile_run
from ampnb.diagnosis.records import Plan, Settings
from ampnb.diagnosis.run import Setup, StepResult, hunt, measure
from ampnb.modes import get_mode


@dataclass(frozen=True, eq=False)
class Details:
    """Instrumented steps by mode, per-layer rows, profiles, the fp64 check and range notes."""

    runs: dict[str, StepResult] = field(default_factory=dict)
    layers: tuple[LayerRow, ...] = ()
    profiles: dict[str, Profile] = field(default_factory=dict)
    fp64: str = "64-true check: did not fit the budget"
    notes: tuple[str, ...] = ()


def fp64_check(setup: Setup, ref: StepResult) -> str:
    """32-true's own error, against the same step in float64 (where the model allows)."""
    mode = get_mode("64-true")
    try:
        exact = measure(setup, Candidate(mode.name, mode, setup.device, None, True, "reference check"), ref=ref)
    except (RuntimeError, TypeError, ValueError) as e:
        return f"64-true could not run this model ({str(e).splitlines()[0][:80]})"
    if not exact.finite:
        return "64-true produced inf/NaN: no fp64 check"
    return (f"32-true's own error against 64-true: loss {rel(ref.loss, exact.loss):.1e}, "
            f"gradients {exact.grad_error:.1e}")


def range_notes(ref: StepResult, cands: list[Candidate]) -> list[str]:
    """How many of 32-true's gradients fp16 flushes to zero, with and without loss scaling."""
    if not any(torch.float16 in (c.mode.autocast_dtype, c.mode.param_dtype) for c in cands):
        return []
    init = float(2**16)
    return [f"gradients that underflow fp16: {underflow(ref.grads, 1.0):.2%} of nonzero values "
            f"without scaling, {underflow(ref.grads, init):.2%} at the GradScaler's initial "
            "scale 2^16"]


def _instrumented(setup: Setup, p: Plan, head: Headline, isl: Islands, s: Settings,
                  clock: Clock) -> tuple[StepResult | None, dict[str, StepResult]]:
    """The instrumented reference and each mode's instrumented step (broken modes first: the
    hunter names where they broke), as they fit."""
    ref = reference(setup, head, p.reference, clock, s.say, isl)
    runs = dict(isl.runs)
    if ref is None:
        return None, runs
    ran = [c for c in (*p.headline, *p.emulated) if c.name in head.runs and c.name not in runs]
    ran.sort(key=lambda c: head.runs[c.name].finite)
    for c in ran:
        if clock.fits(instrumented_cost(head, ref, c.name, clock), f"{c.name}: per-layer errors"):
            s.say(f"{c.name}: instrumented step (per-layer errors)")
            runs[c.name] = measure(setup, c, ref=ref, scale=head.runs[c.name].scale)
    for name, run in list(runs.items()):
        runs[name] = _first_overflow(setup, head, name, run, by_name(p)[name], s, clock)
    return ref, runs


def by_name(p: Plan) -> dict[str, Candidate]:
    """The plan's candidates by name."""
    return {c.name: c for c in (p.reference, *p.headline, *p.emulated)}


def _first_overflow(setup: Setup, head: Headline, name: str, run: StepResult, cand: Candidate,
                    s: Settings, clock: Clock) -> StepResult:
    """A mode whose GradScaler skipped steps in the headline: the steps it skipped, and what
    overflowed at the initial scale (the hunter's step, as it fits)."""
    first = head.runs.get(name)
    if first is None or not first.skipped or run.first_overflow is not None:
        return run
    found = None
    if clock.fits(2 * instrumented_cost(head, None, name, clock),
                  f"{name}: what overflowed at the GradScaler's initial scale"):
        s.say(f"{name}: what overflowed at the initial loss scale (the hunter)")
        found = hunt(setup, cand, (), first.scale * 2.0**first.skipped)
    return dataclasses.replace(run, skipped=first.skipped, first_overflow=found)


def details(setup: Setup, p: Plan, head: Headline, isl: Islands, s: Settings, clock: Clock
            ) -> Details:
    """Per-layer rows, the fp64 check (under the memory cap) and profiles, in that order."""
    ref, runs = _instrumented(setup, p, head, isl, s, clock)
    layers = layer_rows(setup.model, ref, {REFERENCE: ref, **runs}, formats_of(head, p)) \
        if ref is not None else ()
    # a 64-true step holds twice the bytes of 32-true's: weights, gradients, state, activations
    r = head.ref
    need = 2 * (r.param_bytes + r.grad_bytes + r.optimizer_bytes + r.saved_bytes)
    cap = setup.cap or MemoryCap(setup.device)
    fp64 = Details.fp64
    if not cap.fits(need):
        clock.skip("the fp64 check", cap.why(need))
        fp64 = "64-true check: did not fit the memory cap"
    elif clock.fits(3 * clock.plain, "the fp64 check"):
        fp64 = fp64_check(setup, head.ref)
    profiles: dict[str, Profile] = {}
    if s.profile:
        for c in [p.reference, *p.headline]:
            if c.name in head.runs and clock.fits(2 * head.estimates.get(c.name, clock.plain),
                                                  f"profile of {c.name}"):
                profiles[c.name] = profile_run(setup, c, head.runs[c.name].scale, warmup=False)
    ran = [c for c in (*p.headline, *p.emulated) if c.name in head.runs]
    return Details(runs, layers, profiles, fp64, tuple(range_notes(head.ref, ran)))
