"""ampnb.doctor: which mode for this model on this machine, where it breaks, what to keep in fp32."""

from __future__ import annotations

import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampnb._interrupt import Guard
from ampnb.batch import as_batch
from ampnb.device import get_device
from ampnb.diagnosis.arguments import check_model, check_options
from ampnb.diagnosis.budget import Budget, Clock
from ampnb.diagnosis.candidates import REFERENCE, Candidate, candidates
from ampnb.diagnosis.code import code
from ampnb.diagnosis.errors import rel
from ampnb.diagnosis.evidence import MIN_TIMED, ModeRow, acceptable, mode_row, underflow
from ampnb.diagnosis.failures import expected
from ampnb.diagnosis.layers import layer_rows
from ampnb.diagnosis.memory_cap import MemoryCap
from ampnb.diagnosis.profile import Profile, profile_run
from ampnb.diagnosis.recommend import ISLAND_MODES, IslandRow, Tolerance, choose, islands
from ampnb.diagnosis.report import DoctorReport
from ampnb.diagnosis.run import (
    Setup,
    StepResult,
    keeps_model,
    local_errors,
    measure,
    time_steps,
)
from ampnb.diagnosis.safety import restore_state, save_state
from ampnb.diagnosis.training import (
    TRAIN_STEPS,
    TrainCheck,
    inference_check,
    reference_check,
    train_check,
)
from ampnb.formats import get_format
from ampnb.modes import get_mode
from ampnb.start import set_aside, started

SLOW = 4.0  # a candidate whose instrumented step took 4x the reference's is timed MIN_TIMED x
# a mode's plain step against 32-true's, before it has run: "slow" kernels (bf16 without bf16
# units) 2.1-2.5x for whole bf16-mixed steps of GPT-2 5M and 17M on a 2-core Xeon without them
# (one and two threads; a bare matmul is 3-4x, but the other ops stay fp32), emulated ones
# (fp16 GEMMs, TF32, FP8) under 2x
COST_GUESS = {"native": 1.0, "slow": 2.5, "emulated": 2.0}
MAX_RERUNS_SAID = 2  # fewer island reruns than this left: the search is listed as not fitting


class Progress:
    """Prints one line per stage to stderr once the run has taken more than a second."""

    def __init__(self, after: float = 1.0) -> None:
        self.start, self.after = time.perf_counter(), after

    def __call__(self, text: str) -> None:
        if time.perf_counter() - self.start > self.after:
            print(f"ampnb.doctor: {text}", file=sys.stderr, flush=True)


def _fp64_check(setup: Setup, ref: StepResult) -> str:
    """32-true's own error, against the same step in float64 (where the model allows)."""
    mode = get_mode("64-true")
    try:
        exact = measure(setup, Candidate(mode.name, mode, None, True, "reference check"), ref=ref)
    except (RuntimeError, TypeError, ValueError) as e:
        return f"64-true could not run this model ({str(e).splitlines()[0][:80]})"
    if not exact.finite:
        return "64-true produced inf/NaN: no fp64 check"
    return (f"32-true's own error against 64-true: loss {rel(ref.loss, exact.loss):.1e}, "
            f"gradients {exact.grad_error:.1e}")


def _range_notes(ref: StepResult, cands: list[Candidate]) -> list[str]:
    notes = []
    if any(torch.float16 in (c.mode.autocast_dtype, c.mode.param_dtype) for c in cands):
        init = float(2**16)
        notes.append(f"gradients that underflow fp16: {underflow(ref.grads, 1.0):.2%} of nonzero "
                     f"values without scaling, {underflow(ref.grads, init):.2%} at the "
                     f"GradScaler's initial scale 2^16")
    return notes


@dataclass(frozen=True, eq=False)
class DoctorOptions:
    """How the doctor runs: the optimizer to step (None: AdamW), device, modes, tolerance,
    timed repeats, profiling, seed and a progress callback."""

    optimizer: torch.optim.Optimizer | None = None
    device: str | None = None
    modes: Iterable[str] | str | None = None
    tolerance: Any = None
    repeat: int = 3
    profile: bool = True
    seed: int = 0
    progress: Callable[[str], None] | None = None
    budget: Any = None   # None: 15 plain training steps; seconds; 'N steps'; math.inf
    train: bool = True   # False: the model is for inference (one forward decides)
    batches: Any = None  # the multi-step check's batches (cycled); None: the batch, repeated
    scheduler: Any = None  # the user's LR scheduler: the multi-step check runs at its peak


def doctor(model: nn.Module, batch: Any, loss_fn: Callable[..., Any] | None = None, *,
           optimizer: torch.optim.Optimizer | None = None, device: str | None = None,
           modes: Iterable[str] | str | None = None, tolerance: Any = None, repeat: int = 3,
           profile: bool = True, seed: int = 0,
           progress: Callable[[str], None] | None = None, budget: Any = None,
           train: bool = True, batches: Any = None, scheduler: Any = None) -> DoctorReport:
    """Run one step of the model in every candidate mode and recommend one, with evidence and code.

    The user's model, optimizer and torch's global state are left as they were: every run
    starts from one snapshot of them (and of the RNG), kept on disk, with the same batch and
    seed. The work runs in a stated order within `budget` (default 15 plain training steps of
    time); the report lists what did not fit.
    """
    options = DoctorOptions(optimizer, device, modes, tolerance, repeat, profile, seed, progress,
                            budget, train, batches, scheduler)
    return doctor_setup(model, options, batch=batch, loss_fn=loss_fn)


def doctor_setup(model: nn.Module, options: DoctorOptions, *, batch: Any = None,
                 loss_fn: Callable[..., Any] | None = None,
                 step: Callable[[nn.Module], Any] | None = None) -> DoctorReport:
    """The doctor on a batch, or on a step function net -> loss (what `%%amp --doctor` passes)."""
    o = options
    clock = Clock(Budget.of(o.budget))  # from here: probing the device counts too
    check_model(model, o.optimizer, o.repeat)
    check_options(loss_fn, o.device, o.modes, o.seed, o.progress)
    tol = Tolerance.of(o.tolerance)
    if o.scheduler is not None and (o.optimizer is None or
                                    getattr(o.scheduler, "optimizer", None) is not o.optimizer):
        raise ValueError(f"scheduler={type(o.scheduler).__name__} is not allowed; allowed: an LR "
                         "scheduler built on the optimizer= given to the doctor, or None")
    if o.batches is not None and (step is not None or isinstance(o.batches, (str, bytes)) or
                                  not isinstance(o.batches, Iterable)):
        raise ValueError(f"batches={type(o.batches).__name__} is not allowed; allowed: a list of "
                         "batches for the multi-step check (not with a cell's code), or None")
    if not isinstance(o.train, bool):
        raise ValueError(f"train={o.train!r} is not allowed; allowed: True (a training step) or "
                         "False (inference: one forward)")
    dev = get_device(next(model.parameters()).device if o.device is None else o.device).name
    cands, skipped = candidates(o.modes, dev)
    cap = MemoryCap(dev)  # before the doctor's own copies: the peak of the user's training
    data = as_batch(batch, loss_fn).to(dev) if step is None else as_batch(())
    say = o.progress or Progress()
    aside = time.perf_counter()
    with Guard(save_state, restore_state), tempfile.TemporaryDirectory(prefix="ampnb-doctor-") as scratch, \
            started(model, o.optimizer, os.path.join(scratch, "start.pt")) as start, \
            set_aside(start, o.optimizer, os.path.join(scratch, "grads.pt")):
        setup = Setup(start, data, loss_fn, dev, o.seed, step, scratch)
        # putting the user's state back costs about what setting it aside did (not the probing)
        clock.reserve = time.perf_counter() - aside
        return _diagnose(setup, cands, skipped, tol, o.repeat, o.profile, say, clock,
                         o.train, o.batches, o.scheduler, cap)


def _cost(run: StepResult, ref: StepResult, plain: float) -> float:
    """A mode's plain step, estimated from its instrumented step against the reference's."""
    return plain * run.seconds / ref.seconds if ref.seconds > 0 else plain


def _diagnose(setup: Setup, cands: list[Candidate], skipped: list[str], tol: Tolerance,
              repeat: int, profile: bool, say: Callable[[str], None], clock: Clock,
              train: bool = True, batches: Any = None, scheduler: Any = None,
              cap: MemoryCap | None = None) -> DoctorReport:
    n = len(cands)
    mixed = [c for c in cands[1:] if keeps_model(c) or c.mode.is_mixed]
    true = [c for c in cands[1:] if c not in mixed]
    say(f"{REFERENCE} (1/{n}): reference step")
    t0 = time.perf_counter()
    with expected(setup.batch, type(setup.model).__name__, setup.step is not None):
        # the budget's unit: the faster of two plain steps on the reference's warm copy (one
        # slow step on a shared machine would stretch the whole budget)
        ref = measure(setup, cands[0], reference=True, plain=2)
    ref_wall = time.perf_counter() - t0 - sum(ref.plain_seconds)  # the instrumented step's
    if ref.plain_seconds:
        clock.plain = min(ref.plain_seconds)
    if not ref.finite:
        where = f" ({ref.nonfinite.message})" if ref.nonfinite else ""
        raise ValueError(f"the {REFERENCE} step itself produced inf/NaN{where}; the doctor "
                         "compares modes against a finite fp32 step")
    runs: dict[str, StepResult] = {REFERENCE: ref}
    ran = [cands[0]]
    stopped: list[str] = []  # the modes run in order: once one does not fit, neither do the rest

    def run(cand: Candidate) -> None:
        i = cands.index(cand)
        if stopped:
            clock.skip(f"{cand.name}: its step", f"after {stopped[0]}, in the order")
            return
        # a mode's instrumented step costs the reference's, plus its slower arithmetic
        guess = ref_wall + (COST_GUESS.get(cand.label, 1.0) - 1) * clock.plain
        if not clock.fits(guess, f"{cand.name}: its step"):
            stopped.append(cand.name)
            return
        say(f"{cand.name} ({i + 1}/{n}): {cand.how}")
        try:
            runs[cand.name] = measure(setup, cand, ref=ref)
        except RuntimeError as e:  # e.g. a kernel this CPU lacks for the dtype
            skipped.append(f"{cand.name}: could not run this model here "
                           f"({str(e).splitlines()[0][:100]})")
            return
        ran.append(cand)

    # native mixed modes first: the likely answers; emulated ones (a speed that says nothing
    # about this machine) after them
    for cand in [c for c in mixed if c.label != "emulated"]:
        run(cand)
    # timed before the emulated modes: their speed here says nothing about this machine
    times = _time(setup, [c for c in ran if c.label != "emulated"], runs, ref, repeat, clock, say)
    for cand in [c for c in mixed if c.label == "emulated"]:
        run(cand)
    narrow = (get_format(c.mode.compute_dtype).name for c in ran)
    formats = tuple(dict.fromkeys(("fp16", *(f for f in narrow if f not in ("fp32", "fp64")))))
    rows: list[ModeRow] = [mode_row(c, runs[c.name], ref, times.get(c.name),
                                    times.get(REFERENCE)) for c in ran]
    by_name = {c.name: c for c in cands}

    def islands_for(row: ModeRow) -> ModeRow | None:
        cand = by_name[row.name]
        if row.finite and cand.name in ISLAND_MODES and not acceptable(row, tol.loss, tol.grad) \
                and not any(cand.name in v for v in ref.local.values()) and clock.fits(
                    2 * clock.plain, f"local errors of {cand.name} (each leaf alone)"):
            say(f"{cand.name}: each leaf alone on 32-true's inputs (local errors)")
            for leaf, errs in local_errors(setup, [cand]).items():
                ref.local.setdefault(leaf, {}).update(errs)
        layers = layer_rows(setup.model, ref, runs, formats)
        found: dict[tuple[str, ...], StepResult] = {}

        def rerun(keep: tuple[str, ...], cand: Candidate = cand) -> ModeRow:
            say(f"{cand.name} with {', '.join(keep)} kept in fp32: verifying")
            found[keep] = measure(setup, cand, keep, ref=ref)
            return mode_row(cand, found[keep], ref, None, None, keep)

        each = max(runs[cand.name].seconds, 1e-3)
        reruns = None if math.isinf(clock.left) else max(0, int(clock.left // each))
        fixed = islands(row, layers, tol, rerun, max_reruns=reruns)
        if reruns is not None and reruns < MAX_RERUNS_SAID and fixed is None and not acceptable(row, tol.loss, tol.grad) \
                and cand.name in ISLAND_MODES:
            clock.skip(f"fp32 islands for {cand.name}")
        if fixed is None:
            return None
        keep, result = fixed.keep_fp32, found.get(fixed.keep_fp32)
        if result is not None and cand.label != "emulated" and clock.fits(
                repeat * (clock.plain + _cost(result, ref, clock.plain)),
                f"timing {cand.name} with its islands"):
            pair = time_steps(setup, [(cands[0], None, (), repeat), (cand, result.scale, keep,
                                                                      repeat)])
            timed = mode_row(cand, result, ref, pair[1], pair[0], keep)
            fixed = IslandRow.of(timed, fixed.search) if isinstance(fixed, IslandRow) else timed
        rows.append(fixed)
        return fixed

    for row in list(rows[1:]):
        islands_for(row)
    checks: dict[str, TrainCheck] = {}
    reference: list[TrainCheck] = []
    for cand in true:
        run(cand)
        if cand.name not in runs:
            continue
        rows.append(mode_row(cand, runs[cand.name], ref, None, None))
        best = islands_for(rows[-1]) or rows[-1]
        if not train or not acceptable(best, tol.loss, tol.grad):
            continue
        steps = TRAIN_STEPS * (clock.plain + _cost(runs[cand.name], ref, clock.plain))
        if not reference:
            steps += TRAIN_STEPS * clock.plain
        if clock.fits(steps, f"{cand.name}: its {TRAIN_STEPS}-step check beside 32-true's (needed "
                             "before a true mode is recommended for training)"):
            say(f"{cand.name}: {TRAIN_STEPS} training steps beside 32-true's (lost updates)")
            if not reference:
                reference.append(reference_check(setup, batches=batches, scheduler=scheduler))
            checks[cand.name] = train_check(setup, cand, reference=reference[0],
                                            keep=best.keep_fp32, batches=batches,
                                            scheduler=scheduler)
    if not train:  # inference: each mode that passed its step also passes one forward, or not
        for row in rows[1:]:
            if acceptable(row, tol.loss, tol.grad) and row.name not in checks and clock.fits(
                    2 * clock.plain, f"{row.name}: its inference check (one forward)"):
                checks[row.name] = inference_check(setup, by_name[row.name], row.keep_fp32)
    # a 64-true step holds twice the bytes of 32-true's: weights, gradients, state, activations
    cap = cap or MemoryCap(setup.device)
    fp64_bytes = 2 * (ref.param_bytes + ref.grad_bytes + ref.optimizer_bytes + ref.saved_bytes)
    fp64 = "64-true check: did not fit the budget"
    if not cap.fits(fp64_bytes):
        clock.skip("the fp64 check", cap.why(fp64_bytes))
        fp64 = "64-true check: did not fit the memory cap"
    elif clock.fits(3 * ref.seconds, "the fp64 check"):
        fp64 = _fp64_check(setup, ref)
    profiles: dict[str, Profile] = {}
    if profile:
        for cand in [c for c in ran if c.label != "emulated"]:
            if clock.fits(_cost(runs[cand.name], ref, clock.plain) * 2, f"profile of {cand.name}"):
                profiles[cand.name] = profile_run(setup, cand, runs[cand.name].scale, warmup=False)
    layers = layer_rows(setup.model, ref, runs, formats)
    rec, elsewhere = choose(rows, tol, lambda m, k, t: code(m, k, setup.device, t), checks,
                            train=train)
    grads = {c: r.param_errors for c, r in runs.items() if c != REFERENCE}
    return DoctorReport(setup.device, rec, elsewhere, tuple(rows), layers, grads, profiles,
                        tuple(skipped), fp64, tuple(_range_notes(ref, ran)), tol,
                        torch.get_num_threads(), repeat, tuple(clock.left_out), clock.summary(),
                        checks)


def _time(setup: Setup, timed: list[Candidate], runs: dict[str, StepResult], ref: StepResult,
          repeat: int, clock: Clock, say: Callable[[str], None]) -> dict[str, list[float]]:
    """Round-robin step times of 32-true and the modes that fit: `repeat` steps each (fewer for
    a plainly slower mode), dropping the costliest modes until the rounds fit the budget."""
    steps = {c.name: min(repeat, MIN_TIMED) if runs[c.name].seconds > SLOW * ref.seconds
             else repeat for c in timed}
    while len(timed) > 1:
        cost = sum((steps[c.name] + 1) * _cost(runs[c.name], ref, clock.plain) for c in timed)
        if cost <= clock.left:
            break
        drop = max(timed[1:], key=lambda c: runs[c.name].seconds)
        clock.skip(f"timing {drop.name}")
        timed = [c for c in timed if c is not drop]
    if len(timed) < 2:
        return {}
    say(f"timing {len(timed)} modes round-robin ({repeat} steps each, "
        f"{torch.get_num_threads()} threads)")
    found = time_steps(setup, [(c, runs[c.name].scale, (), steps[c.name]) for c in timed])
    return {c.name: t for c, t in zip(timed, found)}
