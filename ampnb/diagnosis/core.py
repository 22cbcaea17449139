"""ampnb.doctor: which mode for this model on this machine, where it breaks, what to keep in fp32."""

from __future__ import annotations

import numbers
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampnb._interrupt import Guard
from ampnb._kernels import drop_overrides, live_overrides
from ampnb.batch import as_batch
from ampnb.device import get_device, restore_tf32, tf32_state
from ampnb.diagnosis.candidates import REFERENCE, Candidate, candidates
from ampnb.diagnosis.code import code
from ampnb.diagnosis.errors import compare, flat, rel
from ampnb.diagnosis.evidence import MIN_TIMED, ModeRow, mode_row, per_param, underflow
from ampnb.diagnosis.failures import expected
from ampnb.diagnosis.layers import layer_rows, local_errors
from ampnb.diagnosis.profile import Profile, profile_run
from ampnb.diagnosis.recommend import ISLAND_MODES, Tolerance, choose, islands
from ampnb.diagnosis.report import DoctorReport
from ampnb.diagnosis.run import Setup, StepResult, measure, time_steps
from ampnb.formats import get_format
from ampnb.modes import get_mode
from ampnb.start import started

SLOW = 4.0  # a candidate whose instrumented step took 4x the reference's is timed MIN_TIMED x
MAX_REPEAT = 100  # timed steps per mode: more says nothing new and can run for hours


class Progress:
    """Prints one line per stage to stderr once the run has taken more than a second."""

    def __init__(self, after: float = 1.0) -> None:
        self.start, self.after = time.perf_counter(), after

    def __call__(self, text: str) -> None:
        if time.perf_counter() - self.start > self.after:
            print(f"ampnb.doctor: {text}", file=sys.stderr, flush=True)


def _save() -> tuple:
    return (torch.get_default_dtype(), tf32_state(), torch.is_grad_enabled(),
            len(_dispatch_stack()), live_overrides())


def _restore(saved: tuple) -> None:
    """Safety net under the with-blocks: what an interrupt inside torch's own set-up could leave."""
    dtype, tf32, grad, depth, overrides = saved
    torch.set_default_dtype(dtype)
    restore_tf32(tf32)
    torch.set_grad_enabled(grad)
    drop_overrides(keep=overrides)  # kernel overrides never handed back (their modes, on old torch)
    while len(_dispatch_stack()) > depth:  # a dispatch mode pushed but never popped
        _pop_mode()


def _dispatch_stack() -> list:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return _get_current_dispatch_mode_stack()


def _pop_mode() -> None:
    from torch.utils._python_dispatch import _pop_mode

    _pop_mode()


def _check(model: Any, optimizer: Any, repeat: int) -> None:
    if not isinstance(model, nn.Module):
        raise ValueError(f"doctor needs an nn.Module, got {type(model).__name__}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"{type(model).__name__} has no trainable parameters to train a step of")
    allowed = "allowed: an optimizer instance over the model's parameters, or None (AdamW)"
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        name = getattr(optimizer, "__name__", type(optimizer).__name__)
        raise ValueError(f"optimizer={name} is not allowed; {allowed}")
    if optimizer is not None:
        own = {id(p) for p in model.parameters()}
        if any(id(p) not in own for g in optimizer.param_groups for p in g["params"]):
            raise ValueError(f"optimizer={type(optimizer).__name__} holds parameters that are "
                             f"not the model's; {allowed}")
    if isinstance(repeat, bool) or not isinstance(repeat, int) or not 1 <= repeat <= MAX_REPEAT:
        raise ValueError(f"repeat={repeat!r} is not allowed; allowed: an integer from 1 to "
                         f"{MAX_REPEAT} (timed steps per mode)")


def _check_options(loss_fn: Any, device: Any, modes: Any, seed: Any, progress: Any = None) -> None:
    """The doctor's other arguments: each named with what is allowed."""
    for name, value, ok, allowed in (
            ("loss_fn", loss_fn, loss_fn is None or callable(loss_fn),
             "a callable loss_fn(output, targets) such as nn.functional.mse_loss, or None (the "
             "model's own loss)"),
            ("device", device, device is None or (isinstance(device, (str, torch.device)) and
                                                  str(device).strip() != ""),
             "a device name such as 'cpu' or 'cuda:0', or None (the model's device)"),
            ("modes", modes, modes is None or isinstance(modes, str) or (
                isinstance(modes, Iterable) and not isinstance(modes, Mapping)),
             "mode names as 'a,b' or a list such as ['32-true', 'bf16-mixed'], or None (every "
             "mode)"),
            ("seed", seed, isinstance(seed, numbers.Integral) and not isinstance(seed, bool),
             "an integer"),
            ("progress", progress, progress is None or callable(progress),
             "a callable taking one line of text, or None (stderr after a second)")):
        if not ok:
            shown = repr(value) if len(repr(value)) <= 40 else f"a {type(value).__name__}"
            raise ValueError(f"{name}={shown} is not allowed; allowed: {allowed}")


def _fp64_check(setup: Setup, ref: StepResult) -> str:
    """32-true's own error, against the same step in float64 (where the model allows)."""
    mode = get_mode("64-true")
    try:
        exact = measure(setup, Candidate(mode.name, mode, None, True, "reference check"))
    except (RuntimeError, TypeError, ValueError) as e:
        return f"64-true could not run this model ({str(e).splitlines()[0][:80]})"
    if not exact.finite:
        return "64-true produced inf/NaN: no fp64 check"
    g = compare(flat([ref.grads[n] for n in exact.grads if n in ref.grads]),
                flat([exact.grads[n] for n in exact.grads if n in ref.grads])).rel
    return (f"32-true's own error against 64-true: loss {rel(ref.loss, exact.loss):.1e}, "
            f"gradients {g:.1e}")


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


def doctor(model: nn.Module, batch: Any, loss_fn: Callable[..., Any] | None = None, *,
           optimizer: torch.optim.Optimizer | None = None, device: str | None = None,
           modes: Iterable[str] | str | None = None, tolerance: Any = None, repeat: int = 3,
           profile: bool = True, seed: int = 0,
           progress: Callable[[str], None] | None = None) -> DoctorReport:
    """Run one step of the model in every candidate mode and recommend one, with evidence and code.

    The user's model, optimizer and torch's global state are left as they were: every run
    starts from one snapshot of them (and of the RNG), with the same batch and seed.
    """
    options = DoctorOptions(optimizer, device, modes, tolerance, repeat, profile, seed, progress)
    return doctor_setup(model, options, batch=batch, loss_fn=loss_fn)


def doctor_setup(model: nn.Module, options: DoctorOptions, *, batch: Any = None,
                 loss_fn: Callable[..., Any] | None = None,
                 step: Callable[[nn.Module], Any] | None = None) -> DoctorReport:
    """The doctor on a batch, or on a step function net -> loss (what `%%amp --doctor` passes)."""
    o = options
    _check(model, o.optimizer, o.repeat)
    _check_options(loss_fn, o.device, o.modes, o.seed, o.progress)
    tol = Tolerance.of(o.tolerance)
    dev = get_device(next(model.parameters()).device if o.device is None else o.device).name
    cands, skipped = candidates(o.modes, dev)
    data = as_batch(batch, loss_fn).to(dev) if step is None else as_batch(())
    say = o.progress or Progress()
    with Guard(_save, _restore), started(model, o.optimizer) as start:
        setup = Setup(start, data, loss_fn, dev, o.seed, step)
        return _diagnose(setup, cands, skipped, tol, o.repeat, o.profile, say)


def _diagnose(setup: Setup, cands: list[Candidate], skipped: list[str], tol: Tolerance,
              repeat: int, profile: bool, say: Callable[[str], None]) -> DoctorReport:
    n = len(cands)
    say(f"{REFERENCE} (1/{n}): reference step")
    with expected(setup.batch, type(setup.model).__name__, setup.step is not None):
        ref = measure(setup, cands[0], reference=True)
    if not ref.finite:
        where = f" ({ref.nonfinite.message})" if ref.nonfinite else ""
        raise ValueError(f"the {REFERENCE} step itself produced inf/NaN{where}; the doctor "
                         "compares modes against a finite fp32 step")
    runs: dict[str, StepResult] = {REFERENCE: ref}
    times: dict[str, list[float]] = {}
    profiles: dict[str, Profile] = {}
    ran = [cands[0]]
    for i, cand in enumerate(cands):
        if i:
            say(f"{cand.name} ({i + 1}/{n}): {cand.how}")
            try:
                runs[cand.name] = measure(setup, cand, ref=ref)
            except RuntimeError as e:  # e.g. a kernel this CPU lacks for the dtype
                skipped.append(f"{cand.name}: could not run this model here "
                               f"({str(e).splitlines()[0][:100]})")
                continue
            ran.append(cand)
    # emulated: its speed here says nothing about hardware that runs it natively
    timed = [c for c in ran if c.label != "emulated"]
    say(f"timing {len(timed)} modes round-robin ({repeat} steps each, "
        f"{torch.get_num_threads()} threads)")
    # plainly slower (its instrumented step took SLOW x the reference's): the fewest steps that
    # still give a spread tell enough
    steps = [min(repeat, MIN_TIMED) if runs[c.name].seconds > SLOW * ref.seconds else repeat
             for c in timed]
    found = time_steps(setup, [(c, runs[c.name].scale, (), k) for c, k in zip(timed, steps)])
    times = {c.name: t for c, t in zip(timed, found)}
    if profile:
        for cand in timed:
            profiles[cand.name] = profile_run(setup, cand, runs[cand.name].scale, warmup=False)
    say("fp64 check and per-layer local errors")
    cands = ran
    fp64 = _fp64_check(setup, ref)
    # Local errors choose fp32 islands, which only the 16-bit modes get (TF32 and FP8 have none).
    local = local_errors(setup, ref, [cands[0], *(c for c in cands[1:] if c.name in ISLAND_MODES)])
    # Headroom where the risk is: fp16's always (layers differ there), plus each narrow format a
    # candidate computes in; fp32/fp64 (about 125+ binades everywhere) would show nothing.
    narrow = (get_format(c.mode.compute_dtype).name for c in cands)
    formats = tuple(dict.fromkeys(("fp16", *(f for f in narrow if f not in ("fp32", "fp64")))))
    layers = layer_rows(setup.model, ref, runs, local, formats)
    rows: list[ModeRow] = [mode_row(c, runs[c.name], ref, times.get(c.name),
                                    times.get(REFERENCE)) for c in cands]
    by_name = {c.name: c for c in cands}
    for row in list(rows[1:]):
        cand = by_name[row.name]

        def rerun(keep: tuple[str, ...], cand: Candidate = cand) -> ModeRow:
            say(f"{cand.name} with {', '.join(keep)} kept in fp32: verifying")
            run = measure(setup, cand, keep, ref=ref)
            pair = [None, None] if cand.label == "emulated" else time_steps(  # against a fresh
                setup, [(cands[0], None, (), repeat), (cand, run.scale, keep, repeat)])  # 32-true
            return mode_row(cand, run, ref, pair[1], pair[0], keep)

        fixed = islands(row, layers, tol, rerun)
        if fixed is not None:
            rows.append(fixed)
    rec, elsewhere = choose(rows, tol, lambda m, k, t: code(m, k, setup.device, t))
    grads = {c: per_param(r.grads, ref.grads) for c, r in runs.items() if c != REFERENCE}
    return DoctorReport(setup.device, rec, elsewhere, tuple(rows), layers, grads, profiles,
                        tuple(skipped), fp64, tuple(_range_notes(ref, cands)), tol,
                        torch.get_num_threads(), repeat)
