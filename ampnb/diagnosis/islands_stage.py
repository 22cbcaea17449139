"""The islands stage: for each mode that broke or strayed, the modules to keep in fp32, found on
instrumented steps (per-module outputs against 32-true's) and verified by reruns, as the budget
allows."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from ampnb.diagnosis.budget import Clock
from ampnb.diagnosis.candidates import REFERENCE, Candidate
from ampnb.diagnosis.evidence import ModeRow, acceptable, mode_row
from ampnb.diagnosis.headline import Headline
from ampnb.diagnosis.layers import layer_rows
from ampnb.diagnosis.recommend import ISLAND_MODES, IslandRow, islands
from ampnb.diagnosis.records import Plan, Settings
from ampnb.diagnosis.run import Setup, StepResult, local_errors, measure, time_steps
from ampnb.formats import get_format

MAX_RERUNS_SAID = 2  # fewer island reruns than this left: the search is listed as not fitting


@dataclass(frozen=True, eq=False)
class Islands:
    """What the islands stage found: rows with verified islands, and the instrumented steps it
    ran (the reference's module outputs, each broken mode's), which the details stage reuses."""

    rows: tuple[ModeRow, ...] = ()
    ref: StepResult | None = None
    runs: dict[str, StepResult] = field(default_factory=dict)


def instrumented_cost(head: Headline, ref: StepResult | None, name: str, clock: Clock,
                      hunt: bool = True) -> float:
    """An instrumented step of a mode: its plain first step times the instruments' overhead
    measured on the reference (twice the plain step before the reference has run), and the
    hunter's step where its first step made inf/NaN and `hunt`."""
    run = head.runs.get(name)
    timed = head.times.get(name)
    plain = clock.plain if name == REFERENCE else statistics.median(timed) if timed else (
        run.seconds if run is not None and math.isfinite(run.seconds) else clock.plain)
    over = ref.seconds / head.ref.seconds if ref is not None and head.ref.seconds > 0 else 2.0
    return plain * over * (1 if run is None or run.finite or not hunt else 2)


def reference(setup: Setup, head: Headline, cand: Candidate, clock: Clock, say: Any,
              isl: Islands) -> StepResult | None:
    """The instrumented reference (module outputs kept), run once for both later stages."""
    if isl.ref is not None:
        return isl.ref
    if not clock.fits(instrumented_cost(head, None, REFERENCE, clock),
                      "the instrumented 32-true step (module outputs, for islands and layers)"):
        return None
    say(f"{REFERENCE}: instrumented step (each module's output kept to compare against)")
    return measure(setup, cand, reference=True)


def formats_of(head: Headline, p: Plan) -> tuple[str, ...]:
    """fp16 and the narrow formats the candidates compute in (the headroom columns)."""
    ran = [c for c in (*p.headline, *p.emulated) if c.name in head.runs]
    narrow = (get_format(c.mode.compute_dtype).name for c in ran)
    return tuple(dict.fromkeys(("fp16", *(f for f in narrow if f not in ("fp32", "fp64")))))


def _broken(found: list[ModeRow], s: Settings) -> list[str]:
    return [r.name for r in found[1:] if r.name in ISLAND_MODES and
            not acceptable(r, s.tol.loss, s.tol.grad)]


def islands_stage(setup: Setup, p: Plan, head: Headline, found: list[ModeRow], s: Settings,
                  clock: Clock) -> Islands:
    """Islands for every island mode out of tolerance or not finite, in the plan's order."""
    isl = Islands()
    by_name = {c.name: c for c in (*p.headline, *p.emulated)}
    for name in _broken(found, s):
        ref = reference(setup, head, p.reference, clock, s.say, isl)
        if ref is None:
            clock.skip(f"fp32 islands for {name}", "the instrumented reference did not fit")
            continue
        isl = Islands(isl.rows, ref, isl.runs)
        cand = by_name[name]
        if not clock.fits(instrumented_cost(head, ref, name, clock), f"{name}: instrumented step"):
            continue
        s.say(f"{name}: instrumented step against 32-true's module outputs")
        run = measure(setup, cand, ref=ref, scale=head.runs[name].scale)
        isl = Islands(isl.rows, ref, {**isl.runs, name: run})
        fixed = _search(setup, p, head, isl, cand, s, clock)
        if fixed is not None:
            isl = Islands((*isl.rows, fixed), ref, isl.runs)
    return isl


def _search(setup: Setup, p: Plan, head: Headline, isl: Islands, cand: Candidate, s: Settings,
            clock: Clock) -> ModeRow | None:
    """The verified 1-minimal islands of one mode (None: none found), timed where they fit."""
    ref, run = isl.ref, isl.runs[cand.name]
    row = mode_row(cand, run, ref, None, None)
    if row.finite and not acceptable(row, s.tol.loss, s.tol.grad) and not any(
            cand.name in v for v in ref.local.values()) and clock.fits(
                2 * clock.plain, f"local errors of {cand.name} (each leaf alone)"):
        s.say(f"{cand.name}: each leaf alone on 32-true's inputs (local errors)")
        for leaf, errs in local_errors(setup, [cand]).items():
            ref.local.setdefault(leaf, {}).update(errs)
    layers = layer_rows(setup.model, ref, {REFERENCE: ref, **isl.runs}, formats_of(head, p))
    kept: dict[tuple[str, ...], StepResult] = {}

    def rerun(keep: tuple[str, ...]) -> ModeRow:
        s.say(f"{cand.name} with {', '.join(keep)} kept in fp32: verifying")
        # From the GradScaler's initial scale, backing off only as far as this island's own
        # gradients need, as the user's training would: the broken run's scale is no working
        # scale (after an overflow no scale cures it is 2^-8, where fp16 gradients underflow).
        kept[keep] = measure(setup, cand, keep, ref=ref)
        return mode_row(cand, kept[keep], ref, None, None, keep)

    # a rerun with islands is hunted only where it still makes inf/NaN: priced without the hunt
    each = max(instrumented_cost(head, ref, cand.name, clock, hunt=False), 1e-3)
    reruns = None if math.isinf(clock.left) else max(0, int(clock.left // (1.25 * each)))
    notes: list[str] = []
    fixed = islands(row, layers, s.tol, rerun, max_reruns=reruns, notes=notes)
    for note in notes:
        clock.skip(f"fp32 islands for {cand.name}", note)
    if reruns is not None and reruns < MAX_RERUNS_SAID and fixed is None:
        clock.skip(f"fp32 islands for {cand.name}")
    if fixed is None:
        return None
    return _timed(setup, p, head, ref, cand, fixed, kept.get(fixed.keep_fp32), s, clock)


def _timed(setup: Setup, p: Plan, head: Headline, ref: StepResult, cand: Candidate, fixed: ModeRow,
           result: StepResult | None, s: Settings, clock: Clock) -> ModeRow:
    """The island row with its speed, timed round-robin beside 32-true where it fits."""
    if result is None or cand.label == "emulated" or not clock.fits(
            s.repeat * (clock.plain + head.estimates.get(cand.name, clock.plain)),
            f"timing {cand.name} with its islands"):
        return fixed
    keep = fixed.keep_fp32
    pair = time_steps(setup, [(p.reference, None, (), s.repeat),
                              (cand, result.scale, keep, s.repeat)])
    timed = mode_row(cand, result, ref, pair[1], pair[0], keep, noise=head.noise)
    return IslandRow.of(timed, fixed.search) if isinstance(fixed, IslandRow) else timed
