"""Every distributed experiment in one launch of 2 ranks (starting ranks is the slow part)."""

from __future__ import annotations

from typing import Any

from ampnb.distributed import ddp, fsdp, reduction
from ampnb.distributed._plan import run_plans


def run_experiments(nproc: int = 2, device: str = "cpu", steps: int = 4) -> dict[str, Any]:
    """DDP dtypes, DDP + GradScaler with an inf on one rank, DDP vs one process, FSDP2's policy
    and scalers, and the gloo check of the simulation (with 2 ranks) — in one launch."""
    plans = {"ddp_dtypes": ddp.dtypes_plan(), "ddp_scaler": ddp.scaler_plan(nproc, steps),
             "ddp_vs_single": ddp.vs_single_plan(steps),
             "fsdp_policy": fsdp.policy_plan("bf16", "fp32", None),
             "fsdp_scaler": fsdp.scaler_plan(nproc)}
    if nproc == 2:
        plans["gloo"] = reduction.gloo_plan()
    return run_plans(plans, nproc, device)
