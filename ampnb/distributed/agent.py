"""`python -m ampnb.distributed.agent JOB_DIR`: torch's elastic agent starting the ranks.

A process of its own (its own session), so that the notebook can end it and every rank with
one kill; it imports torch once and forks the ranks from itself, which saves each rank the
seconds a fresh `import torch` takes.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from ampnb.distributed import worker


def config(nproc: int, port: int, timeout: float) -> LaunchConfig:
    """One node, nproc ranks, a static rendezvous on 127.0.0.1:port, no restarts."""
    return LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id="ampnb",
                        rdzv_backend="static", rdzv_endpoint=f"127.0.0.1:{port}",
                        rdzv_configs={"rank": 0, "timeout": int(timeout)},
                        local_addr="127.0.0.1", max_restarts=0, monitor_interval=0.05,
                        start_method="fork", shutdown_timeout=2)


def main(job_dir: str) -> int:
    job = pickle.loads((Path(job_dir) / "job.pkl").read_bytes())
    try:
        elastic_launch(config(job["nproc"], job["port"], job["timeout"]), worker.main)(job_dir)
    except ChildFailedError:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
