"""Interrupt sweep: deliver a KeyboardInterrupt at each line ampnb executes, as Jupyter would.

A real "interrupt kernel" is a SIGINT: Python runs the SIGINT handler at the next line, and the
default handler raises KeyboardInterrupt there. Where ampnb holds SIGINT back
(`ampnb._interrupt.deferred`), the handler is `_hold`, which only records it. The sweep calls
whatever handler is installed at the chosen line, so it sees exactly what a user would.
Every delivered interrupt must also reach the caller: one that the run swallowed, or that
Python reported as unraisable (raised in a finalizer, where it is lost), is a leak too.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ampnb

PACKAGE = str(Path(ampnb.__file__).resolve().parent)


def _in_ampnb(frame: Any) -> bool:
    return frame.f_code.co_filename.startswith(PACKAGE)


class LineCounter:
    """Counts (or interrupts at) the line events of ampnb's own frames."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.count, self.stop_at, self.fired_at = 0, stop_at, None

    def _local(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            self.count += 1
            if self.count == self.stop_at:
                self.fired_at = f"{frame.f_code.co_filename}:{frame.f_lineno}"
                handler = signal.getsignal(signal.SIGINT)
                if callable(handler):
                    handler(signal.SIGINT, frame)  # default_int_handler raises here
                else:
                    raise KeyboardInterrupt
        return self._local

    def _global(self, frame: Any, event: str, arg: Any) -> Any:
        return self._local if _in_ampnb(frame) else None

    def run(self, fn: Callable[[], Any]) -> Any:
        previous = sys.gettrace()
        sys.settrace(self._global)
        try:
            return fn()
        finally:
            sys.settrace(previous)


def lines_of(fn: Callable[[], Any]) -> int:
    """How many ampnb line events one clean run of fn has."""
    counter = LineCounter()
    counter.run(fn)
    return counter.count


def points(total: int, budget: int) -> list[int]:
    """Up to `budget` interrupt points spread evenly over 1..total (all of them if they fit)."""
    if total <= budget:
        return list(range(1, total + 1))
    return sorted({1 + round(i * (total - 1) / (budget - 1)) for i in range(budget)})


def interrupt_at(k: int, fn: Callable[[], Any]) -> tuple[str | None, list[str]]:
    """Run fn with an interrupt at its k-th ampnb line: (where it fired, how it was lost)."""
    counter, unraisable = LineCounter(stop_at=k), []
    previous, sys.unraisablehook = sys.unraisablehook, unraisable.append
    reached = False
    try:
        counter.run(fn)
    except KeyboardInterrupt:
        reached = True
    finally:
        sys.unraisablehook = previous
    if any(issubclass(u.exc_type, KeyboardInterrupt) for u in unraisable):
        return counter.fired_at, ["the interrupt was ignored in a finalizer"]
    if counter.fired_at and not reached:
        return counter.fired_at, ["the interrupt never reached the caller"]
    return counter.fired_at, []


def sweep(setup: Callable[[], Any], run: Callable[[Any], Any],
          check: Callable[[Any], list[str]], budget: int) -> tuple[int, list[str]]:
    """Interrupt `run(setup())` at sampled lines; returns (points tried, leak descriptions)."""
    total = lines_of(lambda: run(setup()))
    leaks = []
    tried = points(total, budget)
    for k in tried:
        world = setup()
        fired_at, lost = interrupt_at(k, lambda w=world: run(w))
        try:
            problems = check(world)
        except KeyboardInterrupt:  # a held interrupt that surfaced only after the run
            problems = ["an interrupt held during the run was raised only afterwards"]
        problems += lost
        if problems:
            leaks.append(f"line {k}/{total} at {fired_at}: {'; '.join(problems)}")
    return len(tried), leaks
