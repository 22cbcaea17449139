"""Answers that hold over training: K steps of a mode against 32-true's, and the updates it loses.

One step's loss and gradient error say nothing about a true mode's weakness: an update smaller
than half a unit in the last place of a bf16/fp16 weight leaves the weight unchanged, at every
step. `train_check` runs K steps of a candidate with the user's optimizer from the doctor's
snapshot beside the same K steps of 32-true, and counts those lost updates as they happen.

The lost share is measured, not modelled: before each update, a copy of the user's optimizer
steps each parameter once more in fp32, from the mode's weight, optimizer state and gradient
widened exactly to fp32; where that fp32 step moves a weight (the nonzero fp32 update) but the
mode's own step leaves it unchanged, the update was lost. Cost per step: one more optimizer
step, run tensor by tensor (no forward or backward); memory: one tensor's fp32 weight, gradient
and state at a time, plus a copy of the mode's weights and a mask (3 bytes a bf16 parameter)
until its step has run.
"""

from __future__ import annotations

import copy
import functools
import itertools
import math
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ampnb._tree import tensors
from ampnb.batch import Batch, as_batch
from ampnb.diagnosis.candidates import REFERENCE, Candidate, candidate
from ampnb.diagnosis.errors import Err, compare, flat, rel
from ampnb.diagnosis.run import Setup, _copy, _keep
from ampnb.diagnosis.tolerance import Tolerance
from ampnb.diagnosis.weights import eps_causes
from ampnb.putback import seed
from ampnb.step import forward_loss
from ampnb.workbench.state import nonfinite_params

TRAIN_STEPS = 24       # "a few dozen": enough for AdamW's moments to settle, cheap beside the doctor
LOST_MAX = 0.01        # at most 1% of the nonzero fp32 updates may be lost (issue #25)
# Largest relative deviation of the loss from 32-true's at any step. Trajectories part slowly
# even in the mixed modes (bf16 rounding of each step's products); 5% keeps them, and a mode
# that drifts off or stalls beyond it is not what the user's fp32 run would do.
TRAJECTORY_TOL = 0.05
TOP = 5                # offending parameters named in a reason


def _wide(v: Any) -> Any:
    """Optimizer state widened to fp32 exactly ('step' and integer state as they are)."""
    if isinstance(v, torch.Tensor):
        if v.is_floating_point() and v.dtype != torch.float64:
            return v.detach().to(torch.float32, copy=True)
        return v.detach().clone()
    return v


def _positions(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


class _Shadow:
    """The fp32 update the user's optimizer would make from the mode's weights, state and
    gradients, and which of those nonzero updates the mode's own step lost."""

    def __init__(self, opt: torch.optim.Optimizer, names: list[str]) -> None:
        # The same optimizer (class, hyper-parameters, learning rates) over placeholders: each
        # step it is pointed at one fp32 tensor at a time, so it holds one tensor's worth.
        memo: dict[int, Any] = {id(p): torch.empty(0) for p in _positions(opt)}
        memo[id(opt.state)] = defaultdict(dict)
        self.opt32 = copy.deepcopy(opt, memo)
        self.opt, self.names = opt, names
        self.lost = [0] * len(names)
        self.moved = [0] * len(names)
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def _wanted(self, group: int, w: torch.Tensor) -> torch.Tensor:
        """Where one fp32 step of this tensor, from the mode's weight, state and gradient, moves
        it (per-element optimizers update each tensor on its own: torch's all are, but LBFGS)."""
        s = w.detach().to(torch.float32, copy=True).requires_grad_(True)
        s.grad = w.grad.detach().to(torch.float32, copy=True)
        for i, g in enumerate(self.opt32.param_groups):
            g["params"] = [s] if i == group else []
        state = self.opt.state.get(w)
        self.opt32.state.clear()
        if state:
            self.opt32.state[s] = {k: _wide(v) for k, v in state.items()}
        self.opt32.step()
        self.opt32.state.clear()
        return s.detach() != w.detach().float()

    def before_update(self) -> None:
        """Step the shadow: the mode's optimizer holds its weights and unscaled gradients now."""
        self.pending = []
        i = 0
        for group, g in enumerate(self.opt.param_groups):
            for w in g["params"]:
                if w.grad is not None:
                    wanted = self._wanted(group, w)
                    # the weight tensor itself (APEX: the master) and its value before the step
                    self.pending.append((i, w, w.detach().clone(), wanted))
                i += 1
        for g in self.opt32.param_groups:
            g["params"] = []

    def after_update(self, stepped: bool) -> None:
        """Count, for the step just taken, the nonzero fp32 updates its weights did not take."""
        if stepped:  # a GradScaler's skipped step updates nothing on purpose: not counted
            for i, w, was, wanted in self.pending:
                self.lost[i] += int((wanted & (w.detach() == was)).sum())
                self.moved[i] += int(wanted.sum())
        self.pending = []


def _set_lrs(opt: torch.optim.Optimizer, lrs: tuple[float, ...]) -> None:
    for group, lr in zip(opt.param_groups, lrs):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def peak_lrs(optimizer: torch.optim.Optimizer, scheduler: Any = None) -> tuple[float, ...]:
    """Each param group's learning rate: as it is now, or with a scheduler its peak, the largest
    of its `base_lrs`, its `max_lrs` (CyclicLR) and the group's 'max_lr' (OneCycleLR)."""
    lrs = [float(g["lr"]) for g in optimizer.param_groups]
    if scheduler is None:
        return tuple(lrs)
    from torch.optim.lr_scheduler import LRScheduler

    if not isinstance(scheduler, LRScheduler) or scheduler.optimizer is not optimizer:
        raise ValueError(f"scheduler={type(scheduler).__name__} is not allowed; allowed: a torch "
                         "LR scheduler built on the optimizer given to the doctor, or None")
    found = []
    for i, group in enumerate(optimizer.param_groups):
        seen = [scheduler.base_lrs[i], group.get("max_lr", 0.0), group.get("initial_lr", 0.0)]
        seen += [scheduler.max_lrs[i]] if hasattr(scheduler, "max_lrs") else []
        found.append(max(float(x) for x in seen))
    return tuple(found)


@dataclass(frozen=True, eq=False)
class TrainCheck:
    """K training steps of a mode from the doctor's snapshot beside the same K of 32-true."""

    mode: str
    keep_fp32: tuple[str, ...]
    steps: int                              # asked for; `losses` is shorter when it went inf/NaN
    losses: tuple[float, ...]               # the mode's loss at each step
    reference_losses: tuple[float, ...]     # 32-true's at the same steps
    deviation: float                        # largest |loss - 32-true's| / |32-true's| over them
    lost: float                             # lost share of all nonzero fp32 updates, all steps
    lost_by_param: dict[str, float] = field(default_factory=dict)  # name -> its lost share
    lost_counts: dict[str, int] = field(default_factory=dict)      # name -> updates it lost
    bad_weights: tuple[str, ...] = ()       # parameters the steps left inf/NaN
    cause: str = ""                         # why, where known (an eps that is 0 in the dtype)
    optimizer: str = ""
    lrs: tuple[float, ...] = ()             # the learning rate of each param group it ran at
    tolerance: float = TRAJECTORY_TOL
    seconds: float = math.nan               # its steps' wall time (and 32-true's, if run for it)
    kind = "multi-step check"

    def __repr__(self) -> str:
        return f"<TrainCheck {self.mode}: {'passed' if self.ok() else 'failed'} {self.summary}>"

    @property
    def finite(self) -> bool:
        """Every step ran with a finite loss, and the weights ended finite (32-true's too)."""
        return (len(self.losses) == self.steps == len(self.reference_losses) and not
                self.bad_weights and all(map(math.isfinite, self.losses + self.reference_losses)))

    def ok(self, tol: float | None = None) -> bool:
        """Finite, the loss within `tol` (default: its tolerance) of 32-true's at every step, and
        at most LOST_MAX of the nonzero fp32 updates lost."""
        limit = self.tolerance if tol is None else tol
        return self.finite and self.deviation <= limit and self.lost <= LOST_MAX

    @property
    def worst(self) -> tuple[str, ...]:
        """Parameters that lost updates, most lost updates first (at most TOP)."""
        found = sorted((n for n, c in self.lost_counts.items() if c), key=lambda n:
                       (-self.lost_counts[n], n))
        return tuple(found[:TOP])

    @property
    def where_lost(self) -> str:
        """'emb.weight 41.2%, head.weight 3.0%' (each parameter's own lost share)."""
        return ", ".join(f"{n} {self.lost_by_param[n]:.1%}" for n in self.worst)

    @property
    def summary(self) -> str:
        """One line with the figures: trajectory, lost updates and where, finiteness."""
        lr = ", ".join(f"{x:g}" for x in dict.fromkeys(self.lrs))
        head = f"over {self.steps} steps of {self.optimizer} (lr {lr})"
        if not self.finite:
            who = "32-true" if not all(map(math.isfinite, self.reference_losses)) else self.mode
            at = f"inf/NaN at step {len(self.losses)}" if len(self.losses) < self.steps or \
                not math.isfinite(self.losses[-1]) else \
                f"weights left inf/NaN ({', '.join(self.bad_weights[:TOP])})"
            return f"{head}: {who} {at}" + (f" ({self.cause})" if self.cause else "")
        where = f" ({self.where_lost})" if self.worst else ""
        return (f"{head}: loss within {self.deviation:.1e} of 32-true's (tolerance "
                f"{self.tolerance:g}); {self.lost:.1%} of the nonzero fp32 updates left its "
                f"weights unchanged (at most {LOST_MAX:.0%} allowed){where}")


def _batches(setup: Setup, steps: int, batches: Iterable[Any] | None) -> list[Batch]:
    if batches is None:
        return [setup.batch] * steps
    if setup.step is not None:
        raise ValueError("batches= is not allowed with a cell's step function; allowed: None "
                         "(the cell's own step, repeated)")
    given = list(batches) if isinstance(batches, Iterable) and not isinstance(
        batches, (torch.Tensor, str, bytes)) else []
    if not given:
        raise ValueError(f"batches={type(batches).__name__} is not allowed; allowed: a "
                         "non-empty list of batches (cycled over the steps), or None")
    found = [as_batch(b, setup.loss_fn).to(setup.device) for b in given]
    return list(itertools.islice(itertools.cycle(found), steps))


def _run(setup: Setup, cand: Candidate, batches: list[Batch], lrs: tuple[float, ...],
         keep: tuple[str, ...], shadow: bool
         ) -> tuple[list[float], _Shadow | None, tuple[str, ...], str]:
    """K steps of one candidate from the snapshot: (losses, its shadow, weights left inf/NaN,
    a known cause of inf/NaN)."""
    net, opt = _copy(setup, cand)
    _set_lrs(opt, lrs)
    p = cand.bound()
    ids = {id(p): n for n, p in net.named_parameters()}
    names = [ids.get(id(p), f"param {i}") for i, p in enumerate(_positions(opt))]
    watch = _Shadow(opt, names) if shadow else None
    model: Any = net if setup.step is None else functools.partial(setup.step, net)
    losses: list[float] = []
    with _keep(net, keep):
        for i, b in enumerate(batches):
            seed(setup.seed + i, setup.device)  # step i draws the same dropout masks in each run
            with cand.context():
                out = p.step(model, opt, b, setup.loss_fn,
                             before_update=watch and watch.before_update)
            if watch is not None:
                watch.after_update(not out.skipped)
            losses.append(float(out.loss.float()))
            if not math.isfinite(losses[-1]):
                break  # what follows an inf/NaN step says nothing more
    bad = nonfinite_params(net, opt)
    broke = bad or not math.isfinite(losses[-1])
    return losses, watch, bad, "; ".join(eps_causes(opt)) if broke else ""


def _check_steps(steps: Any) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r} is not allowed; allowed: a positive integer "
                         f"(default {TRAIN_STEPS})")


def _check_tol(tol: Any) -> float:
    if tol is None:
        return TRAJECTORY_TOL
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol > 0:
        raise ValueError(f"tol={tol!r} is not allowed; allowed: a positive number (the largest "
                         f"relative loss deviation from 32-true's; default {TRAJECTORY_TOL})")
    return float(tol)


def reference_check(setup: Setup, steps: int = TRAIN_STEPS, *, batches: Iterable[Any] | None = None,
                    scheduler: Any = None) -> TrainCheck:
    """32-true's K steps: the trajectory every candidate is compared with (run it once, pass it
    as `reference=`). Its weights are the fp32 ones, so no update is lost (lost 0, by definition)."""
    _check_steps(steps)
    lrs = peak_lrs(setup.start.optimizer, scheduler)
    t0 = time.perf_counter()
    losses, _, bad, cause = _run(setup, candidate(REFERENCE, setup.device),
                                 _batches(setup, steps, batches), lrs, (), shadow=False)
    return TrainCheck(REFERENCE, (), steps, tuple(losses), tuple(losses), 0.0, 0.0, bad_weights=bad,
                      cause=cause, optimizer=type(setup.start.optimizer).__name__, lrs=lrs,
                      seconds=time.perf_counter() - t0)


def train_check(setup: Setup, cand: Candidate, steps: int = TRAIN_STEPS, *,
                batches: Iterable[Any] | None = None, reference: TrainCheck | None = None,
                tol: float | None = None, scheduler: Any = None, keep: tuple[str, ...] = ()
                ) -> TrainCheck:
    """K steps of `cand` (with `keep` in fp32) on the batch repeated, or on `batches` cycled, at
    the optimizer's learning rate (a scheduler's peak where one is given), beside 32-true's
    (`reference`, else run here): losses, their largest deviation, and the lost updates."""
    _check_steps(steps)
    limit = _check_tol(tol)
    lrs = peak_lrs(setup.start.optimizer, scheduler)
    t0 = time.perf_counter()  # the reference's steps count when they run here
    if reference is None:
        reference = reference_check(setup, steps, batches=batches, scheduler=scheduler)
    elif not (isinstance(reference, TrainCheck) and reference.mode == REFERENCE and
              reference.steps == steps and reference.lrs == lrs):
        shown = reference.mode if isinstance(reference, TrainCheck) else type(reference).__name__
        raise ValueError(f"reference={shown} is not allowed; allowed: reference_check(setup, "
                         f"{steps}) with the same batches and learning rates, or None")
    losses, watch, bad, cause = _run(setup, cand, _batches(setup, steps, batches), lrs,
                                     tuple(keep), True)
    ref = reference.losses
    n = min(len(losses), len(ref))
    deviation = max((rel(a, b) for a, b in zip(losses[:n], ref[:n])), default=math.inf)
    if len(losses) != len(ref):
        deviation = math.inf
    per = {name: watch.lost[i] / watch.moved[i] for i, name in enumerate(watch.names)
           if watch.moved[i]}
    counts = {name: watch.lost[i] for i, name in enumerate(watch.names) if watch.moved[i]}
    moved = sum(watch.moved)
    return TrainCheck(cand.name, tuple(keep), steps, tuple(losses), ref, deviation,
                      sum(watch.lost) / moved if moved else 0.0, per, counts, bad, cause,
                      type(setup.start.optimizer).__name__, lrs, limit, time.perf_counter() - t0)


@dataclass(frozen=True, eq=False)
class InferenceCheck:
    """One forward of a mode against 32-true's (`train=False`): output and loss error."""

    mode: str
    keep_fp32: tuple[str, ...]
    output: Err                 # all floating outputs together, against 32-true's
    loss: float
    reference_loss: float
    loss_error: float
    finite: bool                # the outputs and the loss hold no inf/NaN
    seconds: float = math.nan
    kind = "multi-step check"

    kind = "inference check"

    @property
    def summary(self) -> str:
        """One line with the figures of the forward."""
        return (f"one forward: output error {self.output.text}, loss error "
                f"{self.loss_error:.1e}{'' if self.finite else ', inf/NaN'}")

    def __repr__(self) -> str:
        return f"<InferenceCheck {self.mode}: {self.summary}>"

    def ok(self, tol: Tolerance | None = None) -> bool:
        """Finite, loss error within tol.loss and output error within tol.grad (the doctor's
        tolerance for tensors)."""
        t = Tolerance.of(tol)
        return self.finite and self.loss_error <= t.loss and not self.output.rel > t.grad


def _forward(setup: Setup, cand: Candidate, keep: tuple[str, ...]) -> tuple[torch.Tensor, float]:
    """The model's outputs (flat, float64) and loss after one forward in eval mode, no grad."""
    net, _ = _copy(setup, cand)
    net.eval()  # inference: dropout off, batch norm on its running statistics
    model: Any = net if setup.step is None else functools.partial(setup.step, net)
    seed(setup.seed, setup.device)
    with torch.no_grad(), _keep(net, keep), cand.context():
        raw, loss = forward_loss(cand.bound(), model, setup.batch, setup.loss_fn)
    return flat([t for t in tensors(raw) if t.is_floating_point()]), float(loss.float())


def inference_check(setup: Setup, cand: Candidate, keep: tuple[str, ...] = ()) -> InferenceCheck:
    """One forward of `cand` and one of 32-true from the snapshot: what `train=False` needs."""
    t0 = time.perf_counter()
    want, ref_loss = _forward(setup, candidate(REFERENCE, setup.device), ())
    got, loss = _forward(setup, cand, tuple(keep))
    finite = bool(torch.isfinite(got).all()) and math.isfinite(loss)
    return InferenceCheck(cand.name, tuple(keep), compare(got, want), loss, ref_loss,
                          rel(loss, ref_loss), finite, time.perf_counter() - t0)

