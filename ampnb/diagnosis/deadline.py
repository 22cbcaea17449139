"""Work on the doctor's working copies stopped at a deadline: a slow mode costs what the budget
allows, not what the mode costs (bf16 on a CPU without bf16 units: 19x a plain step)."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from ampnb._tree import tensors

FLOOR = 0.05  # seconds: work shorter than this is never stopped (a first call's costs)
FORWARD_SHARE = 1 / 3  # of a training step, its forward: a step past its time shows there first


class Stopped(Exception):
    """A forward past its deadline: raised by a module pre-hook to end it."""


@contextlib.contextmanager
def until(net: nn.Module, seconds: float, backward: float = math.inf) -> Iterator[None]:
    """The forwards of net's modules stop (Stopped) once `seconds` (at least FLOOR) have passed,
    and the backward through net's outputs once `backward` seconds have; only the doctor's own
    working copies are given (the hooks go with the block, or with the graph)."""
    start = time.perf_counter()
    end = start + max(seconds, FLOOR)
    last = start + max(backward, FLOOR)

    def check(module: nn.Module, args: Any) -> None:
        if time.perf_counter() > end:
            raise Stopped

    live = [True]  # a graph kept past the block (a retained loss) stops nothing after it

    def check_backward(grad_outputs: Any) -> None:
        if live[0] and time.perf_counter() > last:
            raise Stopped

    def graph(module: nn.Module, args: Any, out: Any) -> None:
        _on_nodes(out, check_backward)

    handles = [] if math.isinf(seconds) else [m.register_forward_pre_hook(check)
                                              for m in net.modules()]
    if not math.isinf(backward):
        handles.append(net.register_forward_hook(graph))
    try:
        yield
    finally:
        live[0] = False
        for h in handles:
            h.remove()


def _on_nodes(out: Any, hook: Callable[[Any], None]) -> None:
    """`hook` as a pre-hook on every autograd node behind the tensors in `out` (the graph goes
    with the tensors: the hooks need no removing), but the parameters' gradient accumulators,
    which outlive it."""
    seen: set[Any] = set()
    stack = [t.grad_fn for t in tensors(out) if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen or hasattr(node, "variable"):  # AccumulateGrad
            continue
        seen.add(node)
        node.register_prehook(hook)
        stack.extend(n for n, _ in node.next_functions)
