"""One training step of a candidate on a deep copy, from the same state, batch and seed."""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ampnb._tree import map_tensors, tensors
from ampnb.batch import Batch, step_loss
from ampnb.device import sync
from ampnb.doctor.candidates import Candidate
from ampnb.instruments.hunt import Hunter, NonFinite
from ampnb.instruments.memory import MemoryMeter

MIN_SCALE = 2.0**-8  # a loss scale below this means the gradients overflow whatever the scale


@dataclass(frozen=True, eq=False)
class Setup:
    """What every run starts from: the user's objects (never touched), the batch, the seed."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    batch: Batch
    loss_fn: Callable[..., Any] | None
    device: str
    seed: int = 0
    step: Callable[[nn.Module], Any] | None = None  # a cell's code: net -> loss (batch unused)


@dataclass(frozen=True, eq=False)
class StepResult:
    """What one instrumented step of a candidate measured."""

    name: str
    loss: float
    grads: dict[str, torch.Tensor]
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

    @property
    def finite(self) -> bool:
        """No inf/NaN in the loss, the forward, or the gradients the optimizer got."""
        return math.isfinite(self.loss) and _all_finite(self.grads)


# Ops that allocate without computing: their uninitialised memory may hold inf (FACTS.md).
ALLOCATING = frozenset({"empty_like", "empty", "empty_strided", "new_empty", "new_empty_strided"})


def _all_finite(grads: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(g).all()) for g in grads.values())


def _nbytes(ts: Iterable[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


def _copy(setup: Setup, cand: Candidate) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A converted deep copy of the model and of its optimizer (state included)."""
    with torch.random.fork_rng(devices=[]):
        net, opt = copy.deepcopy((setup.model, setup.optimizer))
    net = cand.mode.convert_module(net.to(setup.device))
    if setup.step is not None:  # code written for the fp32 model: cast its inputs as the mode does
        mode = cand.mode
        net.register_forward_pre_hook(lambda m, a, k: (mode.convert_input(a), mode.convert_input(k)),
                                      with_kwargs=True)
    if opt is None:
        opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-3)
    for p, state in opt.state.items():  # state made for fp32 weights follows the weights
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.shape == p.shape:
                state[k] = v.to(p.device, p.dtype if not cand.mode.is_mixed else v.dtype)
    return net, opt


def _backward(net: nn.Module, setup: Setup, cand: Candidate, scale: float | None) -> float:
    torch.manual_seed(setup.seed)  # the same dropout masks in every run
    mode, dev = cand.mode, setup.device
    batch = setup.batch.convert(mode.convert_input)
    with mode.forward_context(dev):
        if setup.step is not None:
            loss = step_loss(setup.step(net), batch, None)
        else:
            loss = step_loss(batch.call(net), batch, setup.loss_fn)
    (loss.float() * scale if scale else loss.float()).backward()
    return float(loss.detach().float())


def _grads(net: nn.Module, scale: float | None) -> dict[str, torch.Tensor]:
    found = {}
    for name, p in net.named_parameters():
        if p.grad is not None:
            g = p.grad.detach().clone()
            found[name] = g / scale if scale else g
    return found


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


def measure(setup: Setup, cand: Candidate, keep: tuple[str, ...] = (),
            reference: bool = False) -> StepResult:
    """One instrumented step: outputs per module, first inf/NaN op, memory, loss, gradients."""
    net, opt = _copy(setup, cand)
    scaler = cand.mode.make_scaler(setup.device)
    scale = float(scaler.get_scale()) if scaler is not None else None
    before = {n: p.detach().clone() for n, p in net.named_parameters()} if reference else {}
    rec = _Recorder(net, inputs=reference)
    t0 = time.perf_counter()
    try:
        with _keep(net, keep), cand.context(setup.device), MemoryMeter(setup.device) as meter:
            loss = _backward(net, setup, cand, scale)
            grads = _grads(net, scale)
            opt.step()
        sync(setup.device)
    finally:
        rec.remove()
    seconds = time.perf_counter() - t0
    # The hunter checks every op (slow), so it runs only to find where a broken step broke.
    found = NonFinite(False) if math.isfinite(loss) and _all_finite(grads) else hunt(
        setup, cand, keep, scale)
    result = dict(name=cand.name, loss=loss, grads=grads, outputs=rec.outputs,
                  amax={k: _amax(v) for k, v in rec.outputs.items()}, nonfinite=found,
                  saved_bytes=meter.peak_bytes, param_bytes=_nbytes(net.parameters()),
                  grad_bytes=_nbytes(p.grad for p in net.parameters()),
                  optimizer_bytes=_nbytes(v for st in opt.state.values() for v in st.values()),
                  scale=scale, inputs=rec.inputs, before=before,
                  after={n: p.detach().clone() for n, p in net.named_parameters()} if reference
                  else {}, seconds=seconds)
    if scale is not None and math.isfinite(loss) and not _all_finite(grads):
        result.update(_rescale(setup, cand, keep, scale, found))
    return StepResult(**result)


def hunt(setup: Setup, cand: Candidate, keep: tuple[str, ...], scale: float | None) -> NonFinite:
    """The same step again under the non-finite hunter: the first op that made inf/NaN."""
    net, _ = _copy(setup, cand)
    with _keep(net, keep), cand.context(setup.device), Hunter() as hunter:
        _backward(net, setup, cand, scale)
    found = hunter.report()
    return NonFinite(False, ops_checked=found.ops_checked) if found.op in ALLOCATING else found


def _grads_at(setup: Setup, cand: Candidate, keep: tuple[str, ...], scale: float
              ) -> dict[str, torch.Tensor]:
    net, _ = _copy(setup, cand)
    with _keep(net, keep), cand.context(setup.device):
        _backward(net, setup, cand, scale)
        return _grads(net, scale)


def _rescale(setup: Setup, cand: Candidate, keep: tuple[str, ...], scale: float,
             found: NonFinite) -> dict[str, Any]:
    """The largest power-of-two loss scale below the initial one with finite gradients, and the
    steps a GradScaler (halving after each skipped step) would skip to get there."""
    top = round(math.log2(scale))
    low = round(math.log2(MIN_SCALE))
    grads = _grads_at(setup, cand, keep, 2.0**low)
    if not _all_finite(grads):  # no scale helps: the gradients overflow on their own
        return dict(scale=2.0**low, skipped=top - low, first_overflow=found)
    hi = top  # invariant: 2**low gives finite gradients, 2**hi does not
    while hi - low > 1:
        mid = (low + hi) // 2
        found_grads = _grads_at(setup, cand, keep, 2.0**mid)
        if _all_finite(found_grads):
            low, grads = mid, found_grads
        else:
            hi = mid
    return dict(grads=grads, scale=2.0**low, skipped=top - low, first_overflow=found,
                nonfinite=NonFinite(False, ops_checked=found.ops_checked))


def time_steps(setup: Setup, cand: Candidate, repeat: int, scale: float | None = None,
               keep: tuple[str, ...] = (), warmup: int = 1) -> list[float]:
    """Wall times of `repeat` full steps (forward, backward, optimizer step) after warm-up."""
    net, opt = _copy(setup, cand)
    times = []
    with _keep(net, keep), cand.context(setup.device):
        for i in range(repeat + warmup):
            sync(setup.device)
            t0 = time.perf_counter()
            _backward(net, setup, cand, scale)
            if scale:
                for p in net.parameters():
                    if p.grad is not None:
                        p.grad.div_(scale)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync(setup.device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    return times
