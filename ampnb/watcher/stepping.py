"""Hold an interrupt where torch's optimizer step puts grad mode back, while a watch steps it.

torch's optimizers run `step` inside `_use_grad` (or `@torch.no_grad()`), whose `finally`
calls `graph_break()` and then `set_grad_enabled(prev)`: an interrupt landing at either entry
leaves grad mode off for every later cell, with or without ampnb (the next backward fails with
"does not require grad"). A watched step holds an interrupt that lands in that set-up or
restore code (never in the step's own body) and raises it from its post-step hook, once
grad mode is back.
"""

from __future__ import annotations

import dis
import sys
from types import FrameType
from typing import Any

import torch

from ampnb import _interrupt


def _use_grad_code() -> Any:
    """The code of torch's `_use_grad` wrapper (every built-in optimizer's `step`), if any."""
    fn = torch.optim.SGD.step  # once an SGD exists: torch's profiling wrapper around it
    for _ in range(4):
        code = getattr(fn, "__code__", None)
        if code is not None and code.co_name == "_use_grad":
            return code
        fn = getattr(fn, "__wrapped__", None)
    return None


_USE_GRAD = _use_grad_code()
_BODY = frozenset(i.offset for i in dis.get_instructions(_USE_GRAD)
                  if i.opname == "CALL_FUNCTION_EX") if _USE_GRAD is not None else frozenset()
# `@torch.no_grad()` (LBFGS) and a closure's `enable_grad()` put grad mode back in these
_GRAD_EXITS = frozenset((torch.no_grad.__exit__.__code__, torch.enable_grad.__exit__.__code__))
_stepping: set[int] = set()  # ids of the optimizers a watch is stepping now (no finalizer)


def _restoring_grad_mode(frame: FrameType) -> bool:
    """Whether this frame is torch's grad-mode set-up or restore around a watched step."""
    if not _stepping:
        return False
    if frame.f_code is _USE_GRAD:
        return frame.f_lasti not in _BODY  # `func(*args, **kwargs)`: the step itself runs
    return frame.f_code in _GRAD_EXITS


_interrupt._HOLD_IN.append(_restoring_grad_mode)


def started(optimizer: Any) -> None:
    """A watched optimizer's step began (its pre-step hook)."""
    _stepping.add(id(optimizer))


def ended(optimizer: Any) -> None:
    """Its step ended (its post-step hook): an interrupt held in it is raised now."""
    _stepping.discard(id(optimizer))
    if not _stepping:
        _interrupt.raise_held(sys._getframe(1))


def forget(optimizer: Any) -> None:
    """The watch closes (a step that raised never reached its post-step hook)."""
    _stepping.discard(id(optimizer))
