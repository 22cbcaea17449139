"""Mixed precision past one machine: a cell on N local ranks, DDP, FSDP2, reduction precision."""

from __future__ import annotations

from ampnb._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "run_distributed": "ampnb.distributed.run",
    "launch": "ampnb.distributed.launcher",
    "DistributedRun": "ampnb.distributed.launcher",
    "RankFailed": "ampnb.distributed.launcher",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS, set())
