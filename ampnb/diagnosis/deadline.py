"""Work on the doctor's working copies stopped at a deadline: a slow mode costs what the budget
allows, not what the mode costs (bf16 on a CPU without bf16 units: 19x a plain step)."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from typing import Any

from torch import nn

FLOOR = 0.05  # seconds: work shorter than this is never stopped (a first call's costs)
FORWARD_SHARE = 1 / 3  # of a training step, its forward: a step past its time shows there first


class Stopped(Exception):
    """A forward past its deadline: raised by a module pre-hook to end it."""


@contextlib.contextmanager
def until(net: nn.Module, seconds: float) -> Iterator[None]:
    """The forwards of net's modules stop (Stopped) once `seconds` (at least FLOOR) have passed;
    only the doctor's own working copies are given (the hooks go with the block)."""
    end = time.perf_counter() + max(seconds, FLOOR)

    def check(module: nn.Module, args: Any) -> None:
        if time.perf_counter() > end:
            raise Stopped

    handles = [] if math.isinf(seconds) else [m.register_forward_pre_hook(check)
                                              for m in net.modules()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
