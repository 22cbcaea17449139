"""Interrupt sweep: deliver a KeyboardInterrupt at each line ampnb executes, or at each function
entry in any frame (torch's and contextlib's too), as Jupyter would.

A real "interrupt kernel" is a SIGINT: Python runs the SIGINT handler at the next line, or at
the entry of the next function called (`events="calls"`: every Python frame, seen through
`sys.setprofile`), and the default handler raises KeyboardInterrupt there. Where ampnb holds SIGINT back
(`ampnb._interrupt.deferred`), the handler is `_hold`, which only records it. The sweep calls
whatever handler is installed at the chosen line, so it sees exactly what a user would.
Every delivered interrupt must also reach the caller: one that the run swallowed, or that
Python reported as unraisable (raised in a finalizer, where it is lost), is a leak too.
"""

from __future__ import annotations

import contextlib
import gc
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import ampnb

PACKAGE = str(Path(ampnb.__file__).resolve().parent)


@contextlib.contextmanager
def _no_collector() -> Iterator[None]:
    """The cyclic garbage collector off while a run is counted or interrupted: when it runs
    depends on everything the process allocated before (other tests' objects), and its
    callbacks (hypothesis registers one) are function entries too, so the k-th event of a run
    would not be the same event from one run to the next."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _run_with(get: Callable[[], Any], set_: Callable[[Any], None], hook: Any,
              fn: Callable[[], Any]) -> Any:
    """fn() with `hook` as the trace (or profile) function and the collector off."""
    previous = get()
    with _no_collector():
        set_(hook)
        try:
            return fn()
        finally:
            set_(previous)


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
        return _run_with(sys.gettrace, sys.settrace, self._global, fn)


class CallCounter:
    """Counts (or interrupts at) the function entries of every Python frame, anywhere."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.count, self.stop_at, self.fired_at = 0, stop_at, None

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        self.count += 1
        if self.count == self.stop_at:
            sys.setprofile(None)  # one interrupt a run
            code = frame.f_code
            self.fired_at = f"{code.co_filename}:{frame.f_lineno} ({code.co_name})"
            handler = signal.getsignal(signal.SIGINT)
            if callable(handler):
                handler(signal.SIGINT, frame)  # raised in the frame being entered
            else:
                raise KeyboardInterrupt

    def run(self, fn: Callable[[], Any]) -> Any:
        return _run_with(sys.getprofile, sys.setprofile, self._profile, fn)


COUNTERS = {"lines": LineCounter, "calls": CallCounter}


def lines_of(fn: Callable[[], Any], events: str = "lines") -> int:
    """How many ampnb line events (or function entries anywhere) one clean run of fn has."""
    counter = COUNTERS[events]()
    counter.run(fn)
    return counter.count


def points(total: int, budget: int) -> list[int]:
    """Up to `budget` interrupt points spread evenly over 1..total (all of them if they fit)."""
    if total <= budget:
        return list(range(1, total + 1))
    return sorted({1 + round(i * (total - 1) / (budget - 1)) for i in range(budget)})


def _foreign_finalizer(obj: Any) -> bool:
    """A finalizer that loses an interrupt whatever ampnb does: closing a generator as it is
    collected (torch's, or any generator expression: `any(genexpr)` stopping early; it holds no
    cleanup, and CPython 3.11 resumes it to close it), or another library's garbage-collector
    callback (hypothesis registers one) that an interrupt lands in."""
    code = getattr(obj, "gi_code", None) or getattr(getattr(obj, "__func__", obj), "__code__", None)
    return code is not None and (code.co_name == "<genexpr>"
                                 or not code.co_filename.startswith(PACKAGE))


def interrupt_at(k: int, fn: Callable[[], Any], events: str = "lines"
                 ) -> tuple[str | None, list[str]]:
    """Run fn with an interrupt at its k-th event: (where it fired, how it was lost)."""
    counter, unraisable = COUNTERS[events](stop_at=k), []
    previous, sys.unraisablehook = sys.unraisablehook, unraisable.append
    reached, raised = False, None
    try:
        counter.run(fn)
    except KeyboardInterrupt:
        reached = True
    except Exception as err:  # noqa: BLE001 - a run broken by the state an interrupt left
        raised = f"the run raised {type(err).__name__}: {err}"
    finally:
        sys.unraisablehook = previous
    if raised:
        return counter.fired_at, [raised]
    lost = [u for u in unraisable if issubclass(u.exc_type, KeyboardInterrupt)]
    if lost and all(_foreign_finalizer(u.object) for u in lost):
        # closing a generator torch's code left suspended (`all(genexpr)` stopping early) as
        # it is collected: CPython loses an interrupt landing there with or without ampnb
        return None, []
    if lost:
        return counter.fired_at, ["the interrupt was ignored in a finalizer"]
    if counter.fired_at and not reached:
        return counter.fired_at, ["the interrupt never reached the caller"]
    return counter.fired_at, []


def sweep(setup: Callable[[], Any], run: Callable[[Any], Any],
          check: Callable[[Any], list[str]], budget: int, events: str = "lines"
          ) -> tuple[int, list[str]]:
    """Interrupt `run(setup())` at sampled lines of ampnb (events="lines") or function entries
    anywhere (events="calls"); returns (points tried, leak descriptions)."""
    from ampnb.putback_state import Globals

    total = lines_of(lambda: run(setup()), events)
    leaks = []
    tried = points(total, budget)
    clean = Globals.take()
    for k in tried:
        world = setup()
        fired_at, lost = interrupt_at(k, lambda w=world: run(w), events)
        try:
            problems = check(world)
        except KeyboardInterrupt:  # a held interrupt that surfaced only after the run
            problems = ["an interrupt held during the run was raised only afterwards"]
        finally:
            clean.restore()  # one leak is reported once, not again by every later point
        problems += lost
        if problems:
            leaks.append(f"{events[:-1]} {k}/{total} at {fired_at}: {'; '.join(problems)}")
    return len(tried), leaks


def _autocast_nesting() -> int:
    depth = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return depth


def _global_hooks() -> int:
    from torch.nn.modules import module
    from torch.optim import optimizer

    return sum(len(d) for d in (
        module._global_forward_hooks, module._global_forward_pre_hooks,
        module._global_backward_hooks, module._global_backward_pre_hooks,
        optimizer._global_optimizer_pre_hooks, optimizer._global_optimizer_post_hooks))


def process_state() -> tuple:
    """What an interrupt must never leave changed in the process: torch's flags
    (`putback_state.torch_state`), the autocast nesting counter, the function and dispatch mode
    stacks, global module and optimizer hooks, the SIGINT handler, ampnb's per-thread backward
    state, held interrupts."""
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from ampnb import _interrupt, backwards, putback_state

    here = backwards._here
    return (("torch state", putback_state.torch_state()),
            ("autocast nesting", _autocast_nesting()),
            ("function modes", tuple(map(type, _get_current_function_mode_stack()))),
            ("dispatch modes", tuple(map(type, _get_current_dispatch_mode_stack()))),
            ("global hooks", _global_hooks()),
            ("SIGINT handler", signal.getsignal(signal.SIGINT)),
            ("ampnb.backwards", (here.mode, len(getattr(here, "armed", ())), here.held,
                                 here.inside)),
            ("held interrupts", len(_interrupt._pending)))


def changed(before: tuple, after: tuple) -> list[str]:
    """What differs between two `process_state()`s, by name."""
    return [f"{name} {a!r} -> {b!r}" for (name, a), (_, b) in zip(before, after) if a != b]
