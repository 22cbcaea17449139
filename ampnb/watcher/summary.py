"""A step's figures at its end, from what its hooks collected (floats out, no tensor kept)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ampnb.watcher.hooks import StepState, fast_probe, finite, first_nonfinite
from ampnb.watchlog.records import LayerStats, StepRecord


def lost_updates(before: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> float:
    """Share of entries with a nonzero finite gradient whose weight the update left unchanged."""
    lost = total = 0
    for p, w0, moving in before:
        lost += int((moving & (p.detach() == w0)).sum())
        total += int(moving.sum())
    return lost / total if total else 0.0


def nonfinite_grads(modules: list[nn.Module], stats: list[int]) -> int | None:
    """The module last in forward order whose own parameter gradients hold inf/NaN (the first
    that backward reaches): where a backward overflow is put when nothing finer was probed."""
    found = None
    for i in stats:
        gs = [p.grad for p in modules[i].parameters(recurse=False) if p.grad is not None]
        if first_nonfinite(gs) is not None:
            found = i
    return found


def layers(s: StepState, names: list[str], stats: list[int], scale: float | None
           ) -> tuple[LayerStats, ...]:
    """Per stats module: its ranges, unscaled, and the fp16 flush share (one sync per column)."""
    keys = [i for i in stats if i in s.act or i in s.act_grad or i in s.grad]
    if not keys:
        return ()
    nan = torch.tensor(math.nan)
    none = torch.tensor([0, 0])

    def column(d: dict[int, torch.Tensor], empty: torch.Tensor) -> list:
        return torch.stack([d.get(i, empty).cpu().to(empty.dtype) for i in keys]).tolist()
    act, act_grad = column(s.act, nan), column(s.act_grad, nan)
    grad, flush = column(s.grad, nan), column(s.flush, none)
    scaled = scale if scale else 1.0
    return tuple(LayerStats(names[i], act[k], act_grad[k] / scaled,
                            grad[k] / s.divisor if i in s.grad else math.nan,
                            (flush[k][0] / flush[k][1] if flush[k][1] else 0.0)
                            if i in s.flush else math.nan)
                 for k, i in enumerate(keys))


def grads_module(modules: list[nn.Module], stats: list[int]) -> int | None:
    """`nonfinite_grads`, after one read that says whether any gradient is non-finite at all
    (statistics steps, at each backward's end: a skipped step's are gone by its end)."""
    gs = [p.grad for i in stats for p in modules[i].parameters(recurse=False)
          if p.grad is not None]
    if not gs or all(finite([torch.stack([fast_probe(g) for g in gs]).sum()])):
        return None
    return nonfinite_grads(modules, stats)


def _backward_first(s: StepState, modules: list[nn.Module], stats: list[int]
                    ) -> tuple[int | None, str] | None:
    """Statistics steps: where a step whose forward was finite went non-finite in backward."""
    first = s.first_backward()
    if first is None:
        first = s.grads_first if s.grads_first is not None else nonfinite_grads(modules, stats)
    return (first, "backward") if first is not None else None


def step_record(s: StepState, step: int, rank: int, names: list[str], modules: list[nn.Module],
                stats: list[int]) -> StepRecord:
    """An ended step's record: its device values read here (a statistics step's module named)."""
    s.skipped = s.skipped or s.found_inf is not None and bool(s.found_inf)
    loss = s.loss()
    finite = math.isfinite(loss) and (s.grads_probe is None or math.isfinite(float(s.grads_probe)))
    nonfinite = s.skipped or not finite or s.first is not None
    if nonfinite and s.stats and s.first is None:
        s.first = _backward_first(s, modules, stats)
    first, phase = s.first if s.first is not None else (None, "")
    return StepRecord(
        step=step, rank=rank, micro_batches=s.micro_batches, loss=loss, scale=s.scale,
        skipped=s.skipped, nonfinite=nonfinite,
        first_module=names[first] if first is not None else "",
        first_phase=(phase or "backward") if nonfinite and s.stats else "",
        lost_updates=s.lost, seconds=s.seconds, time=s.time, layers=s.layers,
        incomplete=s.incomplete)


def bare_record(s: StepState, step: int, rank: int) -> StepRecord:
    """What is known of a step whose figures could not be read: marked incomplete."""
    return StepRecord(step=step, rank=rank, micro_batches=s.micro_batches, scale=s.scale,
                      skipped=s.skipped, seconds=s.seconds, time=s.time, incomplete=True)
