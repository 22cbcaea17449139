"""ampnb.doctor: which mode for this model on this machine, where it breaks, what to keep in fp32."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampnb.batch import as_batch
from ampnb.device import place_model
from ampnb.diagnosis.arguments import check_model, check_options
from ampnb.diagnosis.budget import Budget, Clock
from ampnb.diagnosis.memory_cap import MemoryCap
from ampnb.diagnosis.pipeline import Settings, diagnose, plan
from ampnb.diagnosis.recommend import Tolerance
from ampnb.diagnosis.report import DoctorReport
from ampnb.diagnosis.run import Setup
from ampnb.putback_state import globals_kept
from ampnb.start import set_aside, started


class Progress:
    """Prints one line per stage to stderr once the run has taken more than a second."""

    def __init__(self, after: float = 1.0) -> None:
        self.start, self.after = time.perf_counter(), after

    def __call__(self, text: str) -> None:
        if time.perf_counter() - self.start > self.after:
            print(f"ampnb.doctor: {text}", file=sys.stderr, flush=True)


@dataclass(frozen=True, eq=False, kw_only=True)
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
    options = DoctorOptions(optimizer=optimizer, device=device, modes=modes, tolerance=tolerance,
                            repeat=repeat, profile=profile, seed=seed, progress=progress,
                            budget=budget, train=train, batches=batches, scheduler=scheduler)
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
    where = place_model(model, o.device)
    dev = where.device
    p = plan(o.modes, dev)  # bad mode names are refused before any work
    cap = MemoryCap(dev)  # before the doctor's own copies: the peak of the user's training
    data = as_batch(batch, loss_fn).to(dev) if step is None else as_batch(())
    say = o.progress or Progress()
    aside = time.perf_counter()
    with globals_kept(), tempfile.TemporaryDirectory(prefix="ampnb-doctor-") as scratch, \
            started(model, o.optimizer, os.path.join(scratch, "start.pt")) as start, \
            set_aside(start, o.optimizer, os.path.join(scratch, "grads.pt")):
        setup = Setup(start, data, loss_fn, dev, o.seed, step, scratch, cap=cap)
        # putting the user's state back costs about what setting it aside did (not the probing)
        clock.reserve = time.perf_counter() - aside
        settings = Settings(tol, o.repeat, o.profile, o.train, o.batches, o.scheduler, say)
        return diagnose(setup, p, settings, clock, where.why)

