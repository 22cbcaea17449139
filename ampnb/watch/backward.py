"""Every open watch sees each backward's roots (its losses) through one shared engine-call hook.

Why not a public mechanism: module, tensor and optimizer hooks never see the loss a plain loop
computes from the model's output, and a `TorchFunctionMode` that sees `Tensor.backward` has to be
on the mode stack through the whole forward (every op then runs through Python: a pass-through
mode cost 1.14-1.17x the demo GPT's bf16-mixed step here, one thread, 200 steps interleaved,
far past the watch's 1.03x budget), or be pushed after the forward and popped
at the backward, which corrupts the stack when a user's own mode straddles that point. So the
watch takes autograd's engine call, as ampnb's cell does (`ampnb.step._engine_in`), once for all
watches: listeners are added and removed in any order, and the last one out puts the call back
(left as a pass-through only where something installed later still wraps it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from ampnb._interrupt import critical
from ampnb.step import _engine_in, _engine_out

# roots -> what to call once that backward has run (None: nothing); one per open watch
Listener = Callable[[list[torch.Tensor]], Callable[[], None] | None]

_listeners: dict[int, tuple[int, Listener]] = {}  # key -> (thread whose backwards it sees, fn)
_installed: list[tuple[Any, Any]] = []  # (what _engine_out puts back, our call), oldest first
_inside = threading.local()  # our call is running in this thread (it may be in the chain twice)
_next = [0]


def _wrap(run: Callable[..., Any], _thread: int) -> Callable[..., Any]:
    def backward(roots: Any, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # noqa: F841 - the user's frames are what matter
        me = threading.get_ident()
        mine = [fn for thread, fn in list(_listeners.values()) if thread == me]
        if (not mine or getattr(_inside, "on", False)
                or not kwargs.get("accumulate_grad", True)):  # autograd.grad: no step's
            return run(roots, *args, **kwargs)
        floats = [r.detach() for r in roots
                  if isinstance(r, torch.Tensor) and r.is_floating_point()]
        after = [a for a in (fn(floats) for fn in mine) if a is not None]
        _inside.on = True
        try:
            out = run(roots, *args, **kwargs)
        finally:
            _inside.on = False
        for a in after:
            a()
        return out
    return backward


def _current() -> Any:
    return getattr(torch.autograd, "_engine_run_backward", None)


@critical
def ensure() -> None:
    """Ours is not the call in effect — none yet, or something installed over it (a `%%amp`
    cell) or a context that put back what it found before ours (a watch opened inside a cell
    that has ended): install it on top (a copy already deeper in the chain passes through)."""
    if not _installed or _current() is not _installed[-1][1]:
        previous = _engine_in(_wrap)
        _installed.append((previous, _current()))


@critical
def listen(fn: Listener) -> Callable[[], None]:
    """See every backward run in this thread from now on; returns what stops it."""
    key = _next[0] = _next[0] + 1
    ensure()
    _listeners[key] = (threading.get_ident(), fn)

    @critical
    def stop() -> None:
        if _listeners.pop(key, None) is None or _listeners:
            return
        while _installed:  # from the newest: ours in effect is put back, one dropped or
            previous, ours = _installed.pop()  # buried under another's is forgotten
            if _current() is ours:
                _engine_out(previous)
    return stop
