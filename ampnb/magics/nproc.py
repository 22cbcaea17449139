"""`%%amp MODE --nproc N`: the cell on N local ranks (torch's elastic launcher), output by rank."""

from __future__ import annotations

import sys
from typing import Any

from IPython.core.error import UsageError

from ampnb.distributed._ship import RankSettings, pack, split_cell
from ampnb.distributed.launcher import (
    DistributedRun,
    RankFailed,
    check_nproc,
    check_timeout,
    launch,
)
from ampnb.magics.cell import CellSyntaxError


def nproc_cell(shell: Any, cell: str, settings: RankSettings, device: str, nproc: int,
               quiet: bool = False, *, timeout: Any) -> DistributedRun:
    """Run the cell on nproc ranks under the settings (each rank enters the cell context), all
    stopped after `timeout` seconds; print each rank's output; RankFailed if one failed."""
    __tracebackhide__ = True  # noqa: F841
    try:
        check_nproc(nproc, device)
        seconds = check_timeout(timeout)
    except ValueError as e:
        raise UsageError(str(e)) from None
    source = shell.transform_cell(cell)
    try:
        body, last = split_cell(source)
    except SyntaxError as e:
        raise CellSyntaxError(shell, e) from None
    filename = shell.compile.cache(source, shell.execution_count, raw_code=cell)
    try:
        payload = pack(body, last, filename, shell.user_ns, settings, source=source)
    except ValueError as e:
        raise UsageError(str(e)) from None
    run = launch(payload, nproc, device, seconds)
    if not quiet:
        sys.stdout.write(run.output())
        sys.stdout.flush()
    if not run.ok:
        raise RankFailed(run)
    return run
