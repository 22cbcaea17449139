"""The doctor's headline: every mode this machine runs natively, through ampnb's fp16 kernels or
slowly, as plain steps.

Each mode's step is first priced by its forward on a slice of the batch; then the modes take
their first steps, cheapest first, from the snapshot: each gives its loss and gradient errors
against 32-true's (no per-module instruments); then the finite ones step round-robin on their
working copies and those steps give the speeds. A mode priced at most SURE plain steps always
runs (unless one step is over the whole budget); a dearer one runs only as it fits, after the
islands of a cheaper mode that broke, and the report says what it would have cost.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ampnb.device import sync
from ampnb.diagnosis.budget import DEFAULT_STEPS, SAFETY, Clock
from ampnb.diagnosis.candidates import REFERENCE, Candidate, candidate
from ampnb.diagnosis.cost import ROUNDS, Prices, ratios, sliced
from ampnb.diagnosis.deadline import FORWARD_SHARE, Stopped, until
from ampnb.diagnosis.rounds import timed_rounds
from ampnb.diagnosis.run import (
    MIN_SCALE,
    Setup,
    StepResult,
    _copy,
    _Grads,
    _nbytes,
    _step,
    _timed,
    keeps_model,
)
from ampnb.diagnosis.stochastic import find
from ampnb.diagnosis.weights import weights_left
from ampnb.instruments.hunt import NonFinite
from ampnb.instruments.memory import MemoryMeter
from ampnb.precision import Precision
from ampnb.step import forward_loss

UNIT_STEPS = 2  # plain 32-true steps after its first: the budget's unit, and the noise
ISLANDS_STEPS = 5.0  # plain steps kept for a broken mixed mode's islands before later work
SURE = 2.0  # a mixed mode priced at most this many steps of the budget always runs in the headline


@dataclass(frozen=True, eq=False)
class Headline:
    """What the headline measured: each mode's first step (errors), its timed steps, the
    machine's step-to-step variation, and each mode's step cost measured before it ran."""

    setup: Setup                                   # with the modules kept from drawing
    ref: StepResult                                # 32-true's first step (its gradients kept)
    runs: dict[str, StepResult]                    # each mode's first step, 32-true's included
    times: dict[str, list[float]]                  # round-robin timed steps per mode
    noise: float | None                            # 32-true's (max - min) / min over its steps
    beside: dict[str, list[float]] = field(default_factory=dict)  # 32-true's steps in its rounds
    estimates: dict[str, float] = field(default_factory=dict)  # seconds per step, beforehand
    too_large: tuple[str, ...] = ()                # modes whose one step is over the budget
    failed: tuple[str, ...] = ()                   # "mode: could not run here (torch's error)"
    copy_seconds: float = 0.0                      # making the fp32 working copy took this


def reset(setup: Setup, net: nn.Module) -> None:
    """The working copy's weights and buffers back at the snapshot's: what a step's loss and
    gradients depend on. The optimizer state is left as it is (twice the weights' bytes, and no
    gradient depends on it); each mode's update then starts from it, which only timing sees."""
    setup.start.master.load_into(net)


def first_step(setup: Setup, cand: Candidate, net: nn.Module, opt: torch.optim.Optimizer,
               ref: StepResult | None, clock: Clock, within: float = math.inf,
               forward: float = math.inf) -> StepResult:
    """A mode's step from the snapshot, its unscaled gradients compared with `ref`'s as they are
    read (`ref` None: the reference, whose gradients are kept). A GradScaler that skips the step
    halves its scale and steps again, as training would: each of those steps counts. A forward
    past `forward` seconds, or a backward past `within`, is stopped (deadline.Stopped)."""
    p = cand.bound()
    scaler = p.scaler
    store = setup.spill() if ref is None else None
    skipped = 0
    while True:
        grads = _Grads(net, None if ref is None else ref.grads, store)
        with cand.context(), MemoryMeter(setup.device) as meter:
            sync(setup.device)
            t0 = time.perf_counter()
            with until(net, forward, backward=within):
                out = _step(net, opt, setup, p, grads)
            sync(setup.device)
            seconds = time.perf_counter() - t0
        # an inf/NaN loss is no gradient overflow: no loss scale helps it, so no step is retried
        if grads.finite or not out.skipped or scaler is None or not torch.isfinite(out.loss).all():
            break
        if float(scaler.get_scale()) < MIN_SCALE or not clock.fits(
                seconds, f"{cand.name}: another step at half the loss scale"):
            break
        skipped += 1
    if store is not None:
        store.seal()
    left = weights_left(net, opt, {}, None)
    return StepResult(
        name=cand.name, loss=float(out.loss.float()), grads_finite=grads.finite,
        grad_error=0.0 if ref is None else grads.error, param_errors=grads.errors,
        end_to_end={}, amax={}, nonfinite=NonFinite(False), saved_bytes=meter.peak_bytes,
        param_bytes=_nbytes(net.parameters()),
        grad_bytes=_nbytes(p.grad for p in net.parameters()),
        optimizer_bytes=_nbytes(v for st in opt.state.values() for v in st.values()),
        scale=out.scale, skipped=skipped, seconds=seconds, grads=store or {}, **left)


def _copy_bytes(ref: StepResult, c: Candidate) -> int:
    """A converted copy's weights, gradients and optimizer state, from the fp32 reference's
    (scaled by the mode's parameter width; optimizer state kept as wide as the weights)."""
    width = c.mode.param_dtype.itemsize / 4 if c.mode.param_dtype.is_floating_point else 1.0
    return int(width * (ref.param_bytes + ref.grad_bytes + ref.optimizer_bytes))


def _noise(times: Sequence[float]) -> float | None:
    return (max(times) - min(times)) / min(times) if len(times) >= 2 and min(times) > 0 else None


def _quiet(setup: Setup, net: nn.Module) -> Setup:
    """The setup with the modules that draw random numbers kept from drawing (found in one
    forward of the working copy, no gradients)."""
    if setup.step is not None:  # a cell's code calls backward itself: watch its whole step
        quiet = find(net, lambda: setup.step(net), grad=True)
    else:
        # a slice of the batch draws from the same modules at an eighth of the cost
        reference = Precision.of("32-true", device=setup.device)
        quiet = find(net, lambda: forward_loss(reference, net, sliced(setup.batch), setup.loss_fn))
    quiet.apply(net)
    return dataclasses.replace(setup, quiet=quiet)


def headline(setup: Setup, ref_cand: Candidate, cands: Sequence[Candidate], clock: Clock,
             repeat: int, say: Callable[[str], None]) -> Headline:
    """32-true's first step and the unit; each candidate's cost (probed), first step and timed
    steps, round-robin."""
    t0 = time.perf_counter()
    net, opt = _copy(setup, ref_cand)  # the working copy of every mode that keeps fp32 weights
    made = time.perf_counter() - t0
    setup = _quiet(setup, net)
    reset(setup, net)  # the forward that found the drawing modules moved BatchNorm's stats
    say(f"{ref_cand.name}: its first step (the reference) and {UNIT_STEPS} plain steps")
    ref = first_step(setup, ref_cand, net, opt, None, clock)
    unit: list[float] = []
    if ref.finite:
        plain = ref_cand.bound()  # 32-true: no scaler
        for _ in range(UNIT_STEPS):
            _timed(setup, ref_cand, net, opt, plain, unit)
        clock.plain = min(unit)
    head = Headline(setup, ref, {ref_cand.name: ref}, {}, None, copy_seconds=made)
    if not ref.finite:
        return head
    copies: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {"fp32": (net, opt)}
    mixed = [c for c in cands if keeps_model(c)]
    head, bound_at = _first_steps(head, ref_cand, mixed, copies, clock, say, must=True)
    times = _rounds(setup, [ref_cand, *_finite(head, mixed)], copies, bound_at, head.estimates,
                    clock, repeat, say, must=True)
    # true modes convert the model (a copy of their own) and are recommended only after a
    # multi-step check: their step, then their timing, as the budget allows, with the islands of
    # a mixed mode that broke kept in hand (they come first in the budget's order)
    true = [c for c in cands if not keeps_model(c)]
    with clock.held(islands_hold(head, mixed, clock)):
        head, more = _first_steps(head, ref_cand, true, copies, clock, say, must=False)
        later = _rounds(setup, [ref_cand, *_finite(head, true)], copies, more, head.estimates,
                        clock, repeat, say, must=False)
    beside = {n: times.get(ref_cand.name, []) for n in times}
    beside.update({n: later.get(ref_cand.name, []) for n in later})
    times.update({n: t for n, t in later.items() if n != ref_cand.name})
    return dataclasses.replace(head, times=times, beside=beside,
                               noise=_noise(unit + times.get(ref_cand.name, [])))


def islands_hold(head: Headline, cands: Sequence[Candidate], clock: Clock) -> float:
    """Seconds to keep for the islands of the candidates whose first step made inf/NaN: the
    instrumented reference, the broken mode's instrumented step and hunt, one verifying rerun."""
    broken = [c for c in cands if c.name in head.runs and not head.runs[c.name].finite]
    return ISLANDS_STEPS * clock.plain if broken else 0.0


def _finite(head: Headline, cands: Sequence[Candidate]) -> list[Candidate]:
    """The candidates whose first step ran and was finite: the ones worth timing (a mode that
    made inf/NaN is not recommended as it is; its islands are timed with them)."""
    return [c for c in cands if c.name in head.runs and head.runs[c.name].finite]


def later_steps(head: Headline, cands: Sequence[Candidate], clock: Clock,
                say: Callable[[str], None]) -> Headline:
    """The emulated modes' first steps (their accuracy; a speed here would say nothing), as the
    budget allows, each priced by its own probe."""
    if not cands:
        return head
    ref_cand = candidate(REFERENCE, head.setup.device)
    return _first_steps(head, ref_cand, cands, {}, clock, say, must=False)[0]


def _first_steps(head: Headline, ref_cand: Candidate, cands: Sequence[Candidate], copies: dict,
                 clock: Clock, say: Callable[[str], None], *, must: bool
                 ) -> tuple[Headline, dict[str, torch.amp.GradScaler | None]]:
    """Each candidate's cost, probed on its working copy before any of them steps, then their
    first steps, cheapest first, each as it fits what is left (`must`, the headline: the copies
    are made without asking); a step larger than the whole budget is never started."""
    setup, plain = head.setup, clock.plain
    priced, prices = _priced(head, ref_cand, cands, copies, clock, must=must)
    estimates = {**head.estimates, **{c.name: plain * prices.ratios.get(c.name, 1.0)
                                      for c, _ in priced}}
    too_large, failed = list(head.too_large), list(head.failed)
    runs = dict(head.runs)
    bound_at: dict[str, Precision] = {}  # each mode at the loss scale its first step settled at
    # the headline's modes that always run are timed once as the limit allows: kept in hand
    committed = plain + sum(estimates[c.name] for c, _ in priced
                            if _sure(c, estimates, clock)) if must else 0.0
    for c, key in sorted(priced, key=lambda ck: estimates[ck[0].name]):
        sure = must and _sure(c, estimates, clock)
        with clock.held(0.0 if sure else committed):
            if not _startable(c, estimates, prices, too_large, clock) or not sure and not _fits(
                    c, runs, estimates, clock):
                continue
            within = _within(runs, clock, sure)
        reset(setup, copies[key][0])
        say(f"{c.name}: its first step ({c.how})")
        # a mode that always runs may take all of it in its forward (fp16 kernels' first calls)
        forward = within if sure else FORWARD_SHARE * within
        try:
            runs[c.name] = first_step(setup, c, *copies[key], head.ref, clock, within, forward)
        except Stopped:  # the slice priced it lower than the whole batch costs (small slices)
            clock.skip(f"{c.name}: its step", f"its first step was stopped past about "
                       f"{within / plain:.1f} plain steps, what it could take (its forward past "
                       f"{forward / plain:.1f}); its forward on a slice of the batch had priced it "
                       f"at about {estimates[c.name] / plain:.1f}")
            continue
        except (RuntimeError, TypeError) as e:  # a kernel this CPU lacks, dtypes that clash
            failed.append(f"{c.name}: its step failed here ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:120]})")
            continue
        estimates[c.name] = runs[c.name].seconds
        scale = runs[c.name].scale
        bound_at[c.name] = c.bound(scale)
    return dataclasses.replace(head, runs=runs, estimates=estimates, too_large=tuple(too_large),
                               failed=tuple(failed)), bound_at


def _priced(head: Headline, ref_cand: Candidate, cands: Sequence[Candidate], copies: dict,
            clock: Clock, *, must: bool) -> tuple[list[tuple[Candidate, str]], Prices]:
    """The candidates given room for their copies and probes, and their probe's prices."""
    plain, priced, probing = clock.plain, [], 0.0
    for c in cands:
        key = "fp32" if keeps_model(c) else c.name
        # a copy of its own costs about what the fp32 working copy did, and its probe about a
        # plain step at most: neither is started without room for them and its step (the probes
        # are work too: they must not eat the time held for a broken mode's islands)
        made = len({"fp32", key} - set(copies)) * head.copy_seconds
        if not must and not clock.fits(probing + made + 2 * plain, f"{c.name}: its step"):
            continue
        if _made(head.setup, head, ref_cand, c, key, copies, clock):
            priced.append((c, key))
            probing += made + plain
    # a mode priced past what is left after the probes cannot fit: its probe stops there (never
    # below twice SURE, where a mode of the headline always runs)
    hand = plain + clock.reserve + probing
    most = max(2 * SURE, (clock.left - hand) / (SAFETY * plain))
    # one probe for all: their sliced forwards interleaved with one series of 32-true's
    return priced, _probe(head.setup, (ref_cand, copies["fp32"][0]) if copies else None,
                          [(c, copies[key][0]) for c, key in priced], plain, most)


def _startable(c: Candidate, estimates: dict[str, float], prices: Prices, too_large: list[str],
               clock: Clock) -> bool:
    """False, said so, where a candidate's probe was stopped (past what is left) or its step is
    priced over the whole budget (listed in too_large)."""
    what, steps = f"{c.name}: its step", estimates[c.name] / clock.plain
    stopped = c.name in prices.stopped
    if estimates[c.name] > clock.budget.limit(clock.plain):
        too_large.append(c.name)
        clock.skip(what, f"one step is {'over ' if stopped else ''}about {steps:.1f} plain steps "
                   f"(its forward on a slice of the batch, measured{' until stopped' * stopped}),"
                   " more than the whole budget")
        return False
    if stopped:
        clock.skip(f"{what}, priced by its forward on a slice of the batch", f"stopped past "
                   f"about {steps:.1f} plain steps; {max(clock.left, 0) / clock.plain:.1f} plain "
                   "steps left")
    return not stopped


def _within(runs: dict[str, StepResult], clock: Clock, sure: bool) -> float:
    """Seconds a mode's first step may take: what is left before the aim (the islands of a mode
    that broke and what the clock holds kept in hand); for a mode that always runs (fp16
    through ampnb's kernels among them: every CPU class examines it), what is left before the
    budget's limit, never less than twice SURE plain steps: a busier machine does not cost it
    its look, nor the budget more than its limit."""
    broken = any(not r.finite for r in runs.values())
    hand = clock.hand + (ISLANDS_STEPS * clock.plain if broken else 0.0)
    if not sure:
        return max((clock.left - hand) / SAFETY, 0.0)
    return max((clock.left_to_limit - hand) / SAFETY, 2 * SURE * clock.plain)


def _fits(c: Candidate, runs: dict[str, StepResult], estimates: dict[str, float], clock: Clock
          ) -> bool:
    """Whether a candidate's priced step fits, with the islands of a mode that broke before it
    kept in hand (cheaper modes step first: an fp16 overflow's islands come before a slow mode)."""
    broken = any(not r.finite for r in runs.values())
    with clock.held(ISLANDS_STEPS * clock.plain if broken else 0.0):
        return clock.fits(estimates[c.name], f"{c.name}: its step, priced by its forward on a "
                                             "slice of the batch")


def _sure(c: Candidate, estimates: dict[str, float], clock: Clock) -> bool:
    """A headline mode that always runs (and is timed): one whose step is priced at most SURE
    steps of the budget (native units, or fp16 through ampnb's fp16 kernels, here); a dearer one
    (no native units, measured so) runs as it fits. A step of the budget is the plain step, or
    its share of the floor where the floor holds (a toy model's millisecond steps)."""
    share = clock.budget.limit(clock.plain) / (clock.budget.steps or DEFAULT_STEPS)
    return estimates.get(c.name, clock.plain) <= SURE * max(clock.plain, share)


def _made(setup: Setup, head: Headline, ref_cand: Candidate, c: Candidate, key: str,
          copies: dict, clock: Clock) -> bool:
    """The fp32 working copy (the probe's 32-true forward runs on it) and the candidate's own,
    made where missing; False when its converted copy would pass the memory cap (said so)."""
    if "fp32" not in copies:
        copies["fp32"] = _copy(setup, ref_cand)
    if key not in copies:
        need = _copy_bytes(head.ref, c)
        if setup.cap is not None and not setup.cap.fits(need):
            clock.skip(f"{c.name}: its step", f"its converted copy {setup.cap.why(need)}")
            return False
        copies[key] = _copy(setup, c)
    return True


def _probe(setup: Setup, ref: tuple[Candidate, nn.Module] | None,
           cands: list[tuple[Candidate, nn.Module]], plain: float, most: float) -> Prices:
    """Each candidate's step over a plain step, from its forward on a slice of the batch against
    32-true's (none for a cell's code, which has no batch to slice: 1.0 is assumed). One sliced
    forward slower than a share of a plain step has said enough (a mode at least about eight
    times slower): that mode's probe ends there; one past `most` times 32-true's is stopped."""
    if setup.step is not None or ref is None or not cands:
        return Prices()
    return ratios(ref, cands, setup.batch, setup.loss_fn, setup.device, stop=plain / (ROUNDS + 1),
                  most=most)


def _rounds(setup: Setup, timed: list[Candidate], copies: dict, bound_at: dict,
            estimates: dict[str, float], clock: Clock, repeat: int,
            say: Callable[[str], None], *, must: bool) -> dict[str, list[float]]:
    """The timing rounds (rounds.timed_rounds) of 32-true and `timed`; when `must` (the
    headline's mixed modes), those that always run are timed in the first round as the
    budget's limit allows."""
    est = {c.name: clock.plain if c is timed[0] else estimates[c.name] for c in timed}
    sure = {c.name for c in timed[1:] if must and _sure(c, est, clock)}
    return timed_rounds(setup, timed, copies, bound_at, est, sure, clock, repeat, say)
