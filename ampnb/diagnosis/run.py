"""One training step of a candidate (`ampnb.step`'s), on a fresh copy from the doctor's snapshot."""

from __future__ import annotations

import contextlib
import functools
import math
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ampnb.apex import master_of
from ampnb.batch import Batch
from ampnb.device import sync
from ampnb.diagnosis.candidates import Candidate
from ampnb.diagnosis.errors import Err, Total, moved
from ampnb.diagnosis.memory_cap import MemoryCap
from ampnb.diagnosis.recorder import Recorder
from ampnb.diagnosis.stochastic import Quiet
from ampnb.diagnosis.store import Store
from ampnb.diagnosis.weights import eps_causes, narrow, weights, weights_left
from ampnb.instruments.hunt import Hunter, NonFinite
from ampnb.instruments.memory import MemoryMeter
from ampnb.modes import PrecisionMode
from ampnb.precision import Precision
from ampnb.putback import seed
from ampnb.start import Start
from ampnb.step import StepOutcome, forward_loss

MIN_SCALE = 2.0**-8  # a loss scale below this means the gradients overflow whatever the scale


@dataclass(frozen=True, eq=False)
class Setup:
    """What every run starts from: the snapshot (the user's objects never touched), the batch,
    the seed, and a folder for what is kept aside on disk."""

    start: Start
    batch: Batch
    loss_fn: Callable[..., Any] | None
    device: str
    seed: int = 0
    step: Callable[[nn.Module], Any] | None = None  # a cell's code: net -> loss (batch unused)
    scratch: str | None = None                     # a temporary folder (None: one is made)
    quiet: Quiet = Quiet()                         # modules kept from drawing random numbers
    cap: MemoryCap | None = None                   # where the reference's tensors may wait

    @property
    def model(self) -> nn.Module:
        """The user's model (its structure and module names)."""
        return self.start.model

    def spill(self) -> Store:
        """A new store for the reference's tensors (memory under the cap, then disk)."""
        root = self.scratch or tempfile.mkdtemp(prefix="ampnb-doctor-")
        return Store(tempfile.mkdtemp(dir=root), self.cap)


@dataclass(frozen=True, eq=False)
class StepResult:
    """What one instrumented step of a candidate measured: figures, not tensors (the reference
    alone keeps its gradients, which moved, and its module outputs on disk)."""

    name: str
    loss: float
    grads_finite: bool
    grad_error: float                          # relative L2 error of all gradients vs the reference
    param_errors: dict[str, float]             # parameter -> relative gradient error
    end_to_end: dict[str, Err]                 # module path -> output error vs the reference
    amax: dict[str, float]                     # module path -> largest finite output magnitude
    nonfinite: NonFinite
    saved_bytes: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    scale: float | None = None                 # the loss scale the gradients were taken at
    skipped: int = 0                           # steps a GradScaler would skip to get there
    first_overflow: NonFinite | None = None    # what overflowed at the scaler's initial scale
    seconds: float = math.nan                  # the instrumented step's wall time (rough)
    bad_weights: tuple[str, ...] = ()          # parameters the optimizer step left inf/NaN
    weights_cause: str = ""                    # why, when it is known
    lost_updates: float | None = None          # share of 32-true's updates this step lost
    plain_seconds: tuple[float, ...] = ()      # plain steps timed after it on the same copy
    # the reference's own (empty in a candidate's result):
    grads: Mapping[str, torch.Tensor] = field(default_factory=dict)  # unscaled, on disk
    moved: dict[str, torch.Tensor] = field(default_factory=dict)   # entries its step changed
    outputs: Store | None = None                                   # module outputs (Store)
    local: dict[str, dict[str, Err]] = field(default_factory=dict)  # leaf -> candidate -> error

    @property
    def finite(self) -> bool:
        """No inf/NaN in the loss, the forward, the gradients, or the weights after the step."""
        return self.step_finite and not self.bad_weights

    @property
    def step_finite(self) -> bool:
        """No inf/NaN in the loss, the forward, or the gradients the optimizer got."""
        return math.isfinite(self.loss) and self.grads_finite


# Ops that allocate without computing: their uninitialised memory may hold inf (checked on torch 2.13: dropout's CPU kernel).
ALLOCATING = frozenset({"empty_like", "empty", "empty_strided", "new_empty", "new_empty_strided"})


def _nbytes(ts: Iterable[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


def _copy(setup: Setup, cand: Candidate) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A fresh model in the candidate's mode and the user's optimizer over it."""
    net, opt = setup.start.copy(cand.mode, setup.device)
    setup.quiet.apply(net)
    if setup.step is not None:  # code written for the fp32 model: cast its inputs as the mode does
        mode = cand.mode
        net.register_forward_pre_hook(lambda m, a, k: (mode.convert_input(a), mode.convert_input(k)),
                                      with_kwargs=True)
    return net, opt


def _grads(net: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The gradients the optimizer sees (an APEX master's, where there is one)."""
    for name, p in net.named_parameters():
        g = master_of(p).grad
        if g is None:
            g = p.grad
        if g is not None:
            yield name, g.detach()


class _Grads:
    """The unscaled gradients of one step, read just before the update: compared with the
    reference's as they are read (a candidate), or kept (the reference itself)."""

    def __init__(self, net: nn.Module, ref: Mapping[str, torch.Tensor] | None,
                 keep: Store | None = None) -> None:
        self.net, self.ref, self.kept = net, ref, keep
        self.total = Total()
        self.errors: dict[str, float] = {}
        self.finite = True

    def __call__(self) -> None:
        for name, g in _grads(self.net):
            if self.kept is not None:
                self.kept.put(name, g.clone())  # the optimizer step may still change it
            elif self.ref is not None and name in self.ref:
                self.errors[name] = self.total.add(g, self.ref[name]).rel
            if self.ref is None or name not in self.ref:
                self.finite = self.finite and bool(torch.isfinite(g).all())
        if self.ref is not None:
            self.finite = self.finite and self.total.finite

    @property
    def error(self) -> float:
        return math.nan if self.ref is None else self.total.err.rel


def _step(net: nn.Module, opt: torch.optim.Optimizer, setup: Setup, p: Precision,
          read: Callable[[], None] | None = None) -> StepOutcome:
    """The one step from the doctor's seed; `read` sees the unscaled gradients before the update."""
    seed(setup.seed, setup.device)  # the same dropout masks in every run
    model = net if setup.step is None else functools.partial(setup.step, net)
    return p.step(model, opt, setup.batch, setup.loss_fn, before_update=read)


def _keep(net: nn.Module, keep: tuple[str, ...]) -> contextlib.AbstractContextManager:
    from ampnb.selective import keep_fp32

    return keep_fp32(net, keep) if keep else contextlib.nullcontext()


def measure(setup: Setup, cand: Candidate, keep: tuple[str, ...] = (), reference: bool = False,
            ref: StepResult | None = None, local: Sequence[Candidate] = (), plain: int = 0,
            scale: float | None = None) -> StepResult:
    """One instrumented step: output error and amax per module, first inf/NaN op, memory, loss,
    gradient error, and what it left in the weights, compared with `ref` (32-true's result) as
    they stream; `reference=True` keeps what the others compare against (and runs each leaf
    alone in the `local` candidates). `plain` more steps, timed, follow on the same warm copy;
    `scale`: a GradScaler's starting scale (the one the headline's step settled at)."""
    net, opt = _copy(setup, cand)
    p = cand.bound(scale)
    # the reference's weights before its step are the snapshot's (on disk): nothing to copy
    before = weights(net) if ref is not None and narrow(cand.mode) else {}
    rec = Recorder(net, setup.device, setup.spill() if reference else None,
                    ref.outputs if ref is not None else None, local if reference else ())
    grads = _Grads(net, None if reference or ref is None else ref.grads,
                   setup.spill() if reference else None)
    t0 = time.perf_counter()
    try:
        with _keep(net, keep), cand.context(), MemoryMeter(setup.device) as meter:
            out = _step(net, opt, setup, p, grads)
        sync(setup.device)
    finally:
        rec.remove()
    seconds = time.perf_counter() - t0
    loss, scale = float(out.loss.float()), out.scale
    found_left = weights_left(net, opt, before, ref)
    if reference:
        start = {n: t for n, t in setup.start.master.values().items() if n in setup.start.master.params}
        moved_now = moved(start, {n: p.detach() for n, p in net.named_parameters()})
        del start
    before = {}
    step_ok = math.isfinite(loss) and grads.finite
    # The hunter checks every op (slow), so it runs only to find where a broken step broke
    # (and, for weights left inf/NaN, only when no known cause names it).
    found = NonFinite(False)
    unknown = found_left["bad_weights"] and not eps_causes(opt)
    sizes = dict(param_bytes=_nbytes(net.parameters()),
                 grad_bytes=_nbytes(p.grad for p in net.parameters()),
                 optimizer_bytes=_nbytes(v for st in opt.state.values() for v in st.values()))
    timed: list[float] = []
    if step_ok:
        for _ in range(plain):
            _timed(setup, cand, net, opt, p, timed)
    del net, opt, out
    if not step_ok or unknown:
        found = hunt(setup, cand, keep, scale)
    if step_ok and unknown and found.op:
        found_left["weights_cause"] += f": {found.message}"
    result = dict(name=cand.name, loss=loss, grads_finite=grads.finite, grad_error=grads.error,
                  param_errors=grads.errors, end_to_end=rec.end_to_end, amax=rec.amax,
                  nonfinite=found, saved_bytes=meter.peak_bytes, scale=scale, seconds=seconds,
                  plain_seconds=tuple(timed), **sizes, **found_left)
    if reference:  # compared with itself: no error
        rec.spill.seal()
        grads.kept.seal()
        result.update(grads=grads.kept, moved=moved_now, outputs=rec.spill, local=rec.local,
                      grad_error=0.0)
    if scale is not None and math.isfinite(loss) and not grads.finite:
        result.update(_rescale(setup, cand, keep, scale, found, ref))
    return StepResult(**result)


def local_errors(setup: Setup, cands: Sequence[Candidate]) -> dict[str, dict[str, Err]]:
    """Each leaf module run alone in each candidate on its fp32 inputs, against its fp32 output,
    during one 32-true forward (no backward): leaf -> candidate -> error. Asked for only when a
    candidate's step was finite but out of tolerance (its islands come from these)."""
    from ampnb.diagnosis.candidates import REFERENCE, candidate

    reference = candidate(REFERENCE, setup.device)
    net, _ = _copy(setup, reference)
    rec = Recorder(net, setup.device, None, None, cands)
    seed(setup.seed, setup.device)
    try:
        with torch.no_grad():
            if setup.step is None:
                forward_loss(reference.bound(), net, setup.batch, setup.loss_fn)
            else:
                with torch.enable_grad():  # a cell's code may call backward itself
                    setup.step(net)
    finally:
        rec.remove()
    return rec.local


def hunt(setup: Setup, cand: Candidate, keep: tuple[str, ...], scale: float | None) -> NonFinite:
    """The same step again under the non-finite hunter: the first op that made inf/NaN."""
    net, opt = _copy(setup, cand)
    with _keep(net, keep), cand.context(), Hunter() as hunter:
        _step(net, opt, setup, cand.bound(scale))
    found = hunter.report()
    return NonFinite(False, ops_checked=found.ops_checked) if found.op in ALLOCATING else found


def _step_at(setup: Setup, cand: Candidate, keep: tuple[str, ...], scale: float,
             ref: StepResult | None) -> tuple[_Grads, dict[str, Any]]:
    """The step with a GradScaler starting at `scale`: (its gradients' figures, what it left)."""
    net, opt = _copy(setup, cand)
    before = weights(net) if ref is not None and narrow(cand.mode) else {}
    grads = _Grads(net, None if ref is None else ref.grads)
    with _keep(net, keep), cand.context():
        _step(net, opt, setup, cand.bound(scale), grads)
    return grads, weights_left(net, opt, before, ref)


def _rescale(setup: Setup, cand: Candidate, keep: tuple[str, ...], scale: float,
             found: NonFinite, ref: StepResult | None) -> dict[str, Any]:
    """The largest power-of-two loss scale below the initial one with finite gradients, and the
    steps a GradScaler (halving after each skipped step) would skip to get there."""
    top = round(math.log2(scale))
    low = round(math.log2(MIN_SCALE))
    grads, left = _step_at(setup, cand, keep, 2.0**low, ref)
    if not grads.finite:  # no scale helps: the gradients overflow on their own
        return dict(scale=2.0**low, skipped=top - low, first_overflow=found)
    hi = top  # invariant: 2**low gives finite gradients, 2**hi does not
    while hi - low > 1:
        mid = (low + hi) // 2
        found_grads, found_left = _step_at(setup, cand, keep, 2.0**mid, ref)
        if found_grads.finite:
            low, grads, left = mid, found_grads, found_left
        else:
            hi = mid
    return dict(grads_finite=True, grad_error=grads.error, param_errors=grads.errors,
                scale=2.0**low, skipped=top - low, first_overflow=found,
                nonfinite=NonFinite(False, ops_checked=found.ops_checked), **left)


def keeps_model(cand: Candidate) -> bool:
    """The mode runs the fp32 model as it is (32-true, the mixed modes, TF32): no converted copy."""
    return type(cand.mode).convert_module is PrecisionMode.convert_module


def time_steps(setup: Setup, runs: Sequence[tuple[Candidate, float | None, tuple[str, ...], int]],
               warmup: int = 1) -> list[list[float]]:
    """Wall times of full steps (forward, backward, optimizer step) of several runs, each
    (candidate, loss scale, fp32 islands, timed steps), after `warmup` untimed rounds. The steps
    go round-robin across the runs, so drift on a shared machine (another job, OpenMP spin) hits
    every mode alike; torch's thread count is left as the user has it. Modes that keep the fp32
    model step one shared copy (each with its own GradScaler): only modes that convert the
    model add a copy."""
    copies: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {}
    steppers = []
    for cand, scale, _, _ in runs:
        key = "fp32" if keeps_model(cand) else cand.name
        if key not in copies:
            copies[key] = _copy(setup, cand)
        steppers.append((*copies[key], cand.bound(scale)))
    times: list[list[float]] = [[] for _ in runs]
    for i in range(warmup + max((n for *_, n in runs), default=0)):
        for (cand, _, keep, n), (net, opt, p), found in zip(runs, steppers, times):
            if i < warmup + n:
                with _keep(net, keep):  # islands per step: runs may share the copy
                    _timed(setup, cand, net, opt, p, found if i >= warmup else [])
    return times


def _timed(setup: Setup, cand: Candidate, net: nn.Module, opt: torch.optim.Optimizer,
           p: Precision, found: list[float]) -> None:
    """One step of one run in its mode's context (autocast is global: entered per step)."""
    with cand.context():
        sync(setup.device)
        t0 = time.perf_counter()
        _step(net, opt, setup, p)
        sync(setup.device)
        found.append(time.perf_counter() - t0)
