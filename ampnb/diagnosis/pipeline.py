"""The doctor as a pipeline of stages over plain records, in the order they run:
candidates → headline → accuracy of emulated modes → islands → training checks → details → report.

Each stage takes what the one before returned. The headline answers the question (every mode
this machine runs natively, through ampnb's fp16 kernels or slowly, as plain steps); the budget
can cut a slow mode's step there (priced first) and what follows it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ampnb.diagnosis.budget import Clock
from ampnb.diagnosis.candidates import REFERENCE, candidates
from ampnb.diagnosis.code import code
from ampnb.diagnosis.details import Details, details
from ampnb.diagnosis.evidence import ModeRow, acceptable, mode_row
from ampnb.diagnosis.failures import expected
from ampnb.diagnosis.headline import Headline, headline, islands_hold, later_steps
from ampnb.diagnosis.islands_stage import Islands, islands_stage
from ampnb.diagnosis.recommend import choose
from ampnb.diagnosis.records import Checks, Plan, Settings
from ampnb.diagnosis.report import DoctorReport
from ampnb.diagnosis.run import Setup, hunt, keeps_model
from ampnb.diagnosis.training import (
    TRAIN_STEPS,
    TrainCheck,
    inference_check,
    reference_check,
    train_check,
)


def plan(modes: Any, device: str) -> Plan:
    """The candidates that run here, the headline's first (mixed before true modes): native,
    slow, and fp16 through ampnb's fp16 kernels (a mode that runs here, at about fp32's speed);
    the emulated ones (FP8, TF32 on a CPU) after them, for their accuracy."""
    cands, skipped = candidates(modes, device)
    ref, rest = cands[0], cands[1:]
    native = [c for c in rest if c.label != "emulated"]
    ordered = [c for c in native if keeps_model(c)] + [c for c in native if not keeps_model(c)]
    return Plan(ref, tuple(ordered), tuple(c for c in rest if c.label == "emulated"),
                tuple(skipped))


def _reference_failed(setup: Setup, p: Plan) -> ValueError:
    found = hunt(setup, p.reference, (), None)
    where = f" ({found.message})" if found.op else ""
    return ValueError(f"the {REFERENCE} step itself produced inf/NaN{where}; the doctor "
                      "compares modes against a finite fp32 step")


def rows(p: Plan, head: Headline, runs: dict) -> list[ModeRow]:
    """One evidence row per mode that ran, the reference first (instrumented figures where the
    details stage measured them, the headline's speeds)."""
    found = []
    for c in (p.reference, *p.headline, *p.emulated):
        run = runs.get(c.name) or head.runs.get(c.name)
        if run is not None:
            found.append(mode_row(c, run, head.ref, head.times.get(c.name),
                                  head.beside.get(c.name, head.times.get(REFERENCE)),
                                  noise=head.noise))
    return found


def checks_stage(setup: Setup, p: Plan, found: list[ModeRow], s: Settings, clock: Clock
                 ) -> Checks:
    """True modes acceptable on one step: their multi-step check beside 32-true's (training);
    every acceptable mode: one forward (inference)."""
    by_name = {c.name: c for c in (*p.headline, *p.emulated)}
    checks: dict[str, TrainCheck] = {}
    if not s.train:
        for row in found[1:]:
            if acceptable(row, s.tol.loss, s.tol.grad) and row.name not in checks and clock.fits(
                    2 * clock.plain, f"{row.name}: its inference check (one forward)"):
                checks[row.name] = inference_check(setup, by_name[row.name], row.keep_fp32)
        return Checks(checks)
    reference: list[TrainCheck] = []
    for row in found[1:]:
        cand = by_name.get(row.name)
        if cand is None or keeps_model(cand) or not acceptable(row, s.tol.loss, s.tol.grad) \
                or row.name in checks:
            continue
        each = row.seconds or clock.plain
        steps = TRAIN_STEPS * (clock.plain + each) if not reference else TRAIN_STEPS * each
        if clock.fits(steps, f"{cand.name}: its {TRAIN_STEPS}-step check beside 32-true's "
                             "(needed before a true mode is recommended for training)"):
            s.say(f"{cand.name}: {TRAIN_STEPS} training steps beside 32-true's (lost updates)")
            if not reference:
                reference.append(reference_check(setup, batches=s.batches, scheduler=s.scheduler))
            checks[cand.name] = train_check(setup, cand, reference=reference[0],
                                            keep=row.keep_fp32, batches=s.batches,
                                            scheduler=s.scheduler)
    return Checks(checks)


def report(setup: Setup, p: Plan, head: Headline, found: list[ModeRow], isl: Islands,
           checks: Checks, more: Details, s: Settings, clock: Clock) -> DoctorReport:
    """The verdict from the rows (islands included), and the evidence as tables."""
    every = found + list(isl.rows)
    rec, elsewhere = choose(every, s.tol, lambda m, k, t: code(m, k, setup.device, t),
                            checks.checks, train=s.train)
    grads = {c: r.param_errors for c, r in {**head.runs, **more.runs}.items() if c != REFERENCE}
    notes = tuple(n for n in (head.setup.quiet.note, *more.notes) if n)
    return DoctorReport(setup.device, rec, elsewhere, tuple(every), more.layers, grads,
                        more.profiles, (*p.skipped, *head.failed), more.fp64, notes, s.tol,
                        torch.get_num_threads(), s.repeat, tuple(clock.left_out),
                        clock.summary(), checks.checks, noise=head.noise,
                        planned=tuple(c.name for c in (p.reference, *p.headline, *p.emulated)))


def diagnose(setup: Setup, p: Plan, s: Settings, clock: Clock,
             why: str = "where the model's parameters are") -> DoctorReport:
    """The stages after the plan, in order."""
    with expected(setup.batch, type(setup.model).__name__, setup.step is not None):
        head = headline(setup, p.reference, p.headline, clock, s.repeat, s.say)
    if not head.ref.finite:
        raise _reference_failed(head.setup, p)
    setup = head.setup  # from here on: the modules that draw random numbers kept from drawing
    with clock.held(islands_hold(head, p.headline, clock)):
        head = later_steps(head, p.emulated, clock, s.say)
    found = rows(p, head, {})
    isl = islands_stage(setup, p, head, found, s, clock)
    checks = checks_stage(setup, p, found + list(isl.rows), s, clock)
    more = details(setup, p, head, isl, s, clock)
    found = rows(p, head, more.runs)
    return dataclasses.replace(report(setup, p, head, found, isl, checks, more, s, clock),
                               device_why=why)
