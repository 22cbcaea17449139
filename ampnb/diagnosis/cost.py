"""What a mode's step costs on this machine, measured before the step runs: the mode's forward
on a slice of the batch against 32-true's (a slow kernel is slow on a slice too)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ampnb._tree import map_tensors, tensors
from ampnb.batch import Batch
from ampnb.device import sync
from ampnb.diagnosis.candidates import Candidate
from ampnb.diagnosis.deadline import FLOOR, Stopped, until
from ampnb.step import forward_loss

SLICE = 8      # the probe's batch: an eighth of the user's (at least 2 samples)
ROUNDS = 2     # probe forwards per mode, interleaved with 32-true's; the fastest counts


def sliced(batch: Batch) -> Batch:
    """The batch cut along its common leading dimension to an eighth (at least 2 samples); the
    batch itself when its tensors share no leading dimension over 2."""
    sizes = {t.shape[0] for t in tensors((batch.args, dict(batch.kwargs), batch.targets))
             if t.dim()}
    if len(sizes) != 1:
        return batch
    size = sizes.pop()
    keep = max(2, size // SLICE)
    if keep >= size:
        return batch
    cut: Callable[[torch.Tensor], torch.Tensor] = lambda t: t[:keep] if t.dim() else t  # noqa: E731
    return Batch(map_tensors(cut, batch.args), map_tensors(cut, dict(batch.kwargs)),
                 map_tensors(cut, batch.targets))


@dataclass(frozen=True)
class Prices:
    """Each candidate's forward over 32-true's on the slice; `stopped`: the candidates whose
    forward passed `most` times 32-true's and was stopped there (their ratio a lower bound)."""

    ratios: dict[str, float] = field(default_factory=dict)
    stopped: frozenset[str] = frozenset()


def _forward(cand: Candidate, net: nn.Module, batch: Batch, loss_fn: Callable | None,
             device: str, most: float = math.inf) -> float:
    p = cand.bound()
    with torch.no_grad(), cand.context(), until(net, most):
        sync(device)
        t0 = time.perf_counter()
        forward_loss(p, net, batch, loss_fn)
        sync(device)
        return time.perf_counter() - t0


def ratios(ref: tuple[Candidate, nn.Module], cands: Sequence[tuple[Candidate, nn.Module]],
           batch: Batch, loss_fn: Callable | None, device: str, stop: float = math.inf,
           most: float = math.inf) -> Prices:
    """Each candidate's forward time on its working copy over 32-true's on the fp32 one, on the
    sliced batch (fastest of ROUNDS, interleaved); one forward slower than `stop` seconds ends
    that candidate's probing (it has said enough), one past `most` times 32-true's (and FLOOR)
    is stopped there; candidates whose forward fails here are left out."""
    small = sliced(batch)
    runs = (ref, *cands)
    times: dict[str, list[float]] = {c.name: [] for c, _ in runs}
    failed: set[str] = set()
    stopped: set[str] = set()
    for _ in range(ROUNDS + 1):  # the first round warms each mode's kernels
        for c, net in runs:
            if c.name in failed | stopped:
                continue
            if times[c.name] and c is not ref[0] and max(times[c.name]) > stop:
                continue
            limit = math.inf if c is ref[0] else most * min(times[ref[0].name])
            try:
                times[c.name].append(_forward(c, net, small, loss_fn, device, limit))
            except Stopped:
                stopped.add(c.name)
                times[c.name] = [max(limit, FLOOR)]
            except (RuntimeError, TypeError, ValueError):
                failed.add(c.name)
    name = ref[0].name
    if name in failed:
        return Prices()
    base = max(min(times[name][1:]), 1e-9)
    return Prices({c.name: min(times[c.name][1:] or times[c.name]) / base for c, _ in cands
                   if c.name not in failed}, frozenset(stopped))
