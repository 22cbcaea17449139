"""Mixed precision past one machine: a cell on N local ranks, DDP, FSDP2, reduction precision."""

from __future__ import annotations

from ampnb._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "run_distributed": "ampnb.distributed.run",
    "launch": "ampnb.distributed.launcher",
    "DistributedRun": "ampnb.distributed.launcher",
    "RankFailed": "ampnb.distributed.launcher",
    "run_experiments": "ampnb.distributed.experiments",
    "ddp_dtypes": "ampnb.distributed.ddp",
    "ddp_scaler": "ampnb.distributed.ddp",
    "ddp_vs_single": "ampnb.distributed.ddp",
    "fsdp_policy": "ampnb.distributed.fsdp",
    "fsdp_scaler": "ampnb.distributed.fsdp",
    "reduction_error": "ampnb.distributed.reduction",
    "simulate_allreduce": "ampnb.distributed.reduction",
    "check_against_gloo": "ampnb.distributed.reduction",
    "take_home": "ampnb.distributed.code",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS, {"ddp", "fsdp", "reduction"})
