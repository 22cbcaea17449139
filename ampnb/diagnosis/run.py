"""One training step of a candidate (`ampnb.step`'s), on a fresh copy from the doctor's snapshot."""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ampnb._tree import map_tensors, tensors
from ampnb.apex import master_of
from ampnb.batch import Batch
from ampnb.device import sync
from ampnb.diagnosis.candidates import Candidate
from ampnb.diagnosis.weights import eps_causes, narrow, weights, weights_left
from ampnb.instruments.hunt import Hunter, NonFinite
from ampnb.instruments.memory import MemoryMeter
from ampnb.start import Start, seed
from ampnb.step import StepOutcome, train_step

MIN_SCALE = 2.0**-8  # a loss scale below this means the gradients overflow whatever the scale


@dataclass(frozen=True, eq=False)
class Setup:
    """What every run starts from: the snapshot (the user's objects never touched), the batch,
    the seed."""

    start: Start
    batch: Batch
    loss_fn: Callable[..., Any] | None
    device: str
    seed: int = 0
    step: Callable[[nn.Module], Any] | None = None  # a cell's code: net -> loss (batch unused)

    @property
    def model(self) -> nn.Module:
        """The user's model (its structure and module names)."""
        return self.start.model


@dataclass(frozen=True, eq=False)
class StepResult:
    """What one instrumented step of a candidate measured."""

    name: str
    loss: float
    grads: dict[str, torch.Tensor]             # unscaled, as the optimizer got them
    outputs: dict[str, torch.Tensor]           # module path -> its outputs, flattened (fp32)
    amax: dict[str, float]                     # module path -> largest finite output magnitude
    nonfinite: NonFinite
    saved_bytes: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    scale: float | None = None                 # the loss scale the gradients were taken at
    skipped: int = 0                           # steps a GradScaler would skip to get there
    first_overflow: NonFinite | None = None    # what overflowed at the scaler's initial scale
    inputs: dict[str, Any] = field(default_factory=dict)  # leaf module -> (args, kwargs), ref only
    before: dict[str, torch.Tensor] = field(default_factory=dict)  # weights before the step
    after: dict[str, torch.Tensor] = field(default_factory=dict)   # and after (reference only)
    seconds: float = math.nan                  # the instrumented step's wall time (rough)
    bad_weights: tuple[str, ...] = ()          # parameters the optimizer step left inf/NaN
    weights_cause: str = ""                    # why, when it is known
    lost_updates: float | None = None          # share of 32-true's updates this step lost

    @property
    def finite(self) -> bool:
        """No inf/NaN in the loss, the forward, the gradients, or the weights after the step."""
        return self.step_finite and not self.bad_weights

    @property
    def step_finite(self) -> bool:
        """No inf/NaN in the loss, the forward, or the gradients the optimizer got."""
        return math.isfinite(self.loss) and _all_finite(self.grads)


# Ops that allocate without computing: their uninitialised memory may hold inf (FACTS.md).
ALLOCATING = frozenset({"empty_like", "empty", "empty_strided", "new_empty", "new_empty_strided"})


def _all_finite(grads: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(g).all()) for g in grads.values())


def _nbytes(ts: Iterable[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


def _copy(setup: Setup, cand: Candidate) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A fresh model in the candidate's mode and the user's optimizer over it."""
    net, opt = setup.start.copy(cand.mode, setup.device)
    if setup.step is not None:  # code written for the fp32 model: cast its inputs as the mode does
        mode = cand.mode
        net.register_forward_pre_hook(lambda m, a, k: (mode.convert_input(a), mode.convert_input(k)),
                                      with_kwargs=True)
    return net, opt


def _scaler(cand: Candidate, device: str, scale: float | None) -> torch.amp.GradScaler | None:
    """The mode's GradScaler (None without one), starting at `scale` when given."""
    if scale is None or not cand.mode.uses_scaler:
        return cand.mode.make_scaler(device)
    return torch.amp.GradScaler(torch.device(device).type, init_scale=scale)


def _grads(net: nn.Module) -> dict[str, torch.Tensor]:
    """The gradients the optimizer sees (an APEX master's, where there is one)."""
    found = {}
    for name, p in net.named_parameters():
        g = master_of(p).grad
        if g is None:
            g = p.grad
        if g is not None:
            found[name] = g.detach().clone()
    return found


def _step(net: nn.Module, opt: torch.optim.Optimizer, setup: Setup, cand: Candidate,
          scaler: torch.amp.GradScaler | None, grads: dict[str, torch.Tensor] | None = None
          ) -> StepOutcome:
    """The one step from the doctor's seed; `grads` gets the unscaled gradients it stepped with."""
    seed(setup.seed, setup.device)  # the same dropout masks in every run
    model = net if setup.step is None else functools.partial(setup.step, net)
    read = None if grads is None else (lambda: grads.update(_grads(net)))
    return train_step(cand.mode, model, opt, setup.batch, setup.loss_fn, device=setup.device,
                      scaler=scaler, before_update=read)


def _first_floats(obj: Any) -> torch.Tensor | None:
    found = [t.detach().reshape(-1).float() for t in tensors(obj) if t.is_floating_point()]
    return torch.cat(found) if found else None


def _amax(t: torch.Tensor) -> float:
    a = t.abs()
    a = a[torch.isfinite(a)]
    return float(a.max()) if a.numel() else math.nan


class _Recorder:
    """Forward hooks on every module of a copy: first-call outputs, and leaf inputs if asked."""

    def __init__(self, net: nn.Module, inputs: bool) -> None:
        self.outputs: dict[str, torch.Tensor] = {}
        self.inputs: dict[str, Any] = {}
        self.handles = []
        for name, module in net.named_modules():
            if not name:
                continue
            self.handles.append(module.register_forward_hook(self._out(name)))
            if inputs and not any(True for _ in module.children()):
                self.handles.append(module.register_forward_pre_hook(self._in(name),
                                                                     with_kwargs=True))

    def _out(self, name: str) -> Callable:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            if name not in self.outputs:
                found = _first_floats(out)
                if found is not None:
                    self.outputs[name] = found
        return hook

    def _in(self, name: str) -> Callable:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            if name not in self.inputs:
                self.inputs[name] = map_tensors(lambda t: t.detach().clone(), (args, kwargs))
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _keep(net: nn.Module, keep: tuple[str, ...]) -> contextlib.AbstractContextManager:
    from ampnb.selective import keep_fp32

    return keep_fp32(net, keep) if keep else contextlib.nullcontext()


def measure(setup: Setup, cand: Candidate, keep: tuple[str, ...] = (), reference: bool = False,
            ref: StepResult | None = None) -> StepResult:
    """One instrumented step: outputs per module, first inf/NaN op, memory, loss, gradients,
    and the weights it left (lost updates measured against `ref`, 32-true's result)."""
    net, opt = _copy(setup, cand)
    scaler = cand.mode.make_scaler(setup.device)
    before = weights(net) if reference or (ref is not None and narrow(cand.mode)) else {}
    rec = _Recorder(net, inputs=reference)
    grads: dict[str, torch.Tensor] = {}
    t0 = time.perf_counter()
    try:
        with _keep(net, keep), cand.context(setup.device), MemoryMeter(setup.device) as meter:
            out = _step(net, opt, setup, cand, scaler, grads)
        sync(setup.device)
    finally:
        rec.remove()
    seconds = time.perf_counter() - t0
    loss, scale = float(out.loss.float()), out.scale
    found_left = weights_left(net, opt, before, ref)
    step_ok = math.isfinite(loss) and _all_finite(grads)
    # The hunter checks every op (slow), so it runs only to find where a broken step broke
    # (and, for weights left inf/NaN, only when no known cause names it).
    found = NonFinite(False)
    unknown = found_left["bad_weights"] and not eps_causes(opt)
    if not step_ok or unknown:
        found = hunt(setup, cand, keep, scale)
    if step_ok and unknown and found.op:
        found_left["weights_cause"] += f": {found.message}"
    result = dict(name=cand.name, loss=loss, grads=grads, outputs=rec.outputs,
                  amax={k: _amax(v) for k, v in rec.outputs.items()}, nonfinite=found,
                  saved_bytes=meter.peak_bytes, param_bytes=_nbytes(net.parameters()),
                  grad_bytes=_nbytes(p.grad for p in net.parameters()),
                  optimizer_bytes=_nbytes(v for st in opt.state.values() for v in st.values()),
                  scale=scale, inputs=rec.inputs, before=before if reference else {},
                  after=weights(net) if reference else {}, seconds=seconds, **found_left)
    if scale is not None and math.isfinite(loss) and not _all_finite(grads):
        result.update(_rescale(setup, cand, keep, scale, found, ref))
    return StepResult(**result)


def hunt(setup: Setup, cand: Candidate, keep: tuple[str, ...], scale: float | None) -> NonFinite:
    """The same step again under the non-finite hunter: the first op that made inf/NaN."""
    net, opt = _copy(setup, cand)
    with _keep(net, keep), cand.context(setup.device), Hunter() as hunter:
        _step(net, opt, setup, cand, _scaler(cand, setup.device, scale))
    found = hunter.report()
    return NonFinite(False, ops_checked=found.ops_checked) if found.op in ALLOCATING else found


def _step_at(setup: Setup, cand: Candidate, keep: tuple[str, ...], scale: float,
             ref: StepResult | None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The step with a GradScaler starting at `scale`: (unscaled gradients, what it left)."""
    net, opt = _copy(setup, cand)
    before = weights(net) if ref is not None and narrow(cand.mode) else {}
    grads: dict[str, torch.Tensor] = {}
    with _keep(net, keep), cand.context(setup.device):
        _step(net, opt, setup, cand, _scaler(cand, setup.device, scale), grads)
    return grads, weights_left(net, opt, before, ref)


def _rescale(setup: Setup, cand: Candidate, keep: tuple[str, ...], scale: float,
             found: NonFinite, ref: StepResult | None) -> dict[str, Any]:
    """The largest power-of-two loss scale below the initial one with finite gradients, and the
    steps a GradScaler (halving after each skipped step) would skip to get there."""
    top = round(math.log2(scale))
    low = round(math.log2(MIN_SCALE))
    grads, left = _step_at(setup, cand, keep, 2.0**low, ref)
    if not _all_finite(grads):  # no scale helps: the gradients overflow on their own
        return dict(scale=2.0**low, skipped=top - low, first_overflow=found)
    hi = top  # invariant: 2**low gives finite gradients, 2**hi does not
    while hi - low > 1:
        mid = (low + hi) // 2
        found_grads, found_left = _step_at(setup, cand, keep, 2.0**mid, ref)
        if _all_finite(found_grads):
            low, grads, left = mid, found_grads, found_left
        else:
            hi = mid
    return dict(grads=grads, scale=2.0**low, skipped=top - low, first_overflow=found,
                nonfinite=NonFinite(False, ops_checked=found.ops_checked), **left)


def time_steps(setup: Setup, runs: Sequence[tuple[Candidate, float | None, tuple[str, ...], int]],
               warmup: int = 1) -> list[list[float]]:
    """Wall times of full steps (forward, backward, optimizer step) of several runs, each
    (candidate, loss scale, fp32 islands, timed steps), after `warmup` untimed rounds. The steps
    go round-robin across the runs, so drift on a shared machine (another job, OpenMP spin) hits
    every mode alike; torch's thread count is left as the user has it."""
    copies = []
    for cand, scale, _, _ in runs:
        net, opt = _copy(setup, cand)
        copies.append((net, opt, _scaler(cand, setup.device, scale)))
    times: list[list[float]] = [[] for _ in runs]
    with contextlib.ExitStack() as islands:  # each copy's own modules: all held at once
        for (_, _, keep, _), (net, _, _) in zip(runs, copies):
            islands.enter_context(_keep(net, keep))
        for i in range(warmup + max((n for *_, n in runs), default=0)):
            for (cand, _, _, n), (net, opt, scaler), found in zip(runs, copies, times):
                if i < warmup + n:
                    _timed(setup, cand, net, opt, scaler, found if i >= warmup else [])
    return times


def _timed(setup: Setup, cand: Candidate, net: nn.Module, opt: torch.optim.Optimizer,
           scaler: torch.amp.GradScaler | None, found: list[float]) -> None:
    """One step of one run in its mode's context (autocast is global: entered per step)."""
    with cand.context(setup.device):
        sync(setup.device)
        t0 = time.perf_counter()
        _step(net, opt, setup, cand, scaler)
        sync(setup.device)
        found.append(time.perf_counter() - t0)
