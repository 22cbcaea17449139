"""An experiment on ranks as data: the worker each rank runs, its arguments, and the result builder.

Several plans share one launch (`run_plans`): starting ranks costs seconds, running a worker
on ranks already up costs milliseconds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Plan:
    """worker(rank, world_size, device, **kwargs) on every rank; build(values by rank) -> result."""

    worker: Callable[..., Any]
    build: Callable[[tuple[Any, ...]], Any]
    kwargs: dict[str, Any] = field(default_factory=dict)


def _many(rank: int, world_size: int, device: torch.device,
          jobs: list[tuple[Callable[..., Any], dict[str, Any]]]) -> list[Any]:
    """Each job's worker in turn, on the ranks of one launch."""
    return [worker(rank, world_size, device, **kwargs) for worker, kwargs in jobs]


def run_plans(plans: dict[str, Plan], nproc: int = 2, device: str = "cpu") -> dict[str, Any]:
    """Run every plan in one launch of nproc ranks; name -> built result."""
    from ampnb.distributed.run import run_distributed

    jobs = [(p.worker, p.kwargs) for p in plans.values()]
    run = run_distributed(_many, nproc, device=device, show_output=False, jobs=jobs)
    return {name: plan.build(tuple(v[i] for v in run.values))
            for i, (name, plan) in enumerate(plans.items())}


def run_plan(plan: Plan, nproc: int = 2, device: str = "cpu") -> Any:
    """One plan in a launch of its own."""
    return run_plans({"one": plan}, nproc, device)["one"]
