"""torch's profiler start/stop lines kept out of notebooks, and nothing else written lost.

torch's C++ profiler writes `USDT:... profiler_start` / `profiler_stop` to file descriptor 2
when a profile starts and stops (KINETO_LOG_LEVEL does not silence it); JupyterLab shows them
in red under the cell. While a start or stop runs, descriptor 2 goes to a temporary file; then
every line but those goes back to descriptor 2.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from ampnb._interrupt import deferred

CHATTER = re.compile(rb"^USDT:.*\] profiler_(start|stop)\s*$")


def without_chatter(fn: Callable[[], Any]) -> Any:
    """fn() with the profiler's start/stop lines dropped from descriptor 2 (the rest kept).

    An interrupt is held until descriptor 2 is back (the swap is process-wide)."""
    sys.stderr.flush()
    with deferred(), tempfile.TemporaryFile() as caught:
        saved = os.dup(2)
        os.dup2(caught.fileno(), 2)
        try:
            return fn()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().splitlines(keepends=True)
                    if not CHATTER.match(line)]
            if kept:
                os.write(2, b"".join(kept))


class QuietProfile:
    """`with QuietProfile(torch.profiler.profile(...)) as prof:`, without the start/stop lines."""

    def __init__(self, profiler: Any) -> None:
        self.profiler = profiler

    def __enter__(self) -> Any:
        return without_chatter(self.profiler.__enter__)

    def __exit__(self, *exc: Any) -> Any:
        return without_chatter(lambda: self.profiler.__exit__(*exc))
