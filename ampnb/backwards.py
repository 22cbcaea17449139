"""Each backward the user's code starts (`Tensor.backward`, `torch.autograd.backward`,
`torch.autograd.grad`), seen through a `TorchFunctionMode`: torch's public way to see calls
to its functions. Nothing in torch or in the user's objects is replaced.

One mode per thread serves every listener (a `%%amp` cell turning autocast off for its
backward, each open `ampnb.watch` reading its roots), added and removed in any order; the
mode leaves the stack with the last listener.

A mode on the stack costs every op a Python call (a pass-through mode: 1.12x the demo GPT's
bf16-mixed step on one CPU thread). Nearly all of a step's ops run inside a module's forward
or an optimizer's step, where no step's backward starts (a backward inside a forward runs in
that forward's autocast region in torch's recipe too), so the owners of those hooks
`suspend` the mode there and `resume` it after: what it sees is the loss, the backward call
and a GradScaler's few ops.

The stack is read and changed with the accessors `TorchFunctionMode.__enter__`/`__exit__`
use; only this module touches them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import (
    TorchFunctionMode,
    _get_current_function_mode,
    _get_current_function_mode_stack,
    _pop_mode,
    _push_mode,
)

from ampnb._interrupt import Guard, critical

GRAD = torch.autograd.grad
CALLS = frozenset({torch.Tensor.backward, torch.autograd.backward, GRAD})

# (the call: one of CALLS, its roots) -> a context the backward runs in (None: nothing)
Listener = Callable[[Callable[..., Any], list[torch.Tensor]], contextlib.AbstractContextManager
                    | None]


class _Here(threading.local):
    mode: _Mode | None = None   # this thread's mode (on the stack, or held aside)
    held: tuple[Any, _Mode] | None = None  # (the key that suspended it, the mode)
    inside = False              # a backward a listener saw runs now: nested ones pass


_here = _Here()


def roots(func: Callable[..., Any], args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The floating tensors a backward call starts from (detached)."""
    first = args[0] if args else kwargs.get("outputs" if func is GRAD else "tensors",
                                             kwargs.get("self"))
    found = [first] if isinstance(first, torch.Tensor) else list(first or ())
    return [t.detach() for t in found if isinstance(t, torch.Tensor) and t.is_floating_point()]


class _Mode(TorchFunctionMode):
    """Runs each backward call inside its listeners' contexts; every other call as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.listeners: dict[int, Listener] = {}
        self.thread = threading.get_ident()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        __tracebackhide__ = True  # noqa: F841 - IPython shows the user's frames, not this one
        kwargs = kwargs or {}
        if func not in CALLS or not self.listeners or _here.inside:
            return func(*args, **kwargs)
        found = roots(func, args, kwargs)
        with contextlib.ExitStack() as stack:
            for listener in list(self.listeners.values()):
                context = listener(func, found)
                if context is not None:
                    stack.enter_context(context)
            # a Guard: an interrupt landing as the flag is set or cleared cannot leave it set
            # (every later backward would then pass unseen)
            with Guard(_inside, _outside):
                return func(*args, **kwargs)


def _inside() -> None:
    _here.inside = True


def _outside(_: None) -> None:
    _here.inside = False


_next = [0]


@critical
def listen(listener: Listener) -> Callable[[], None]:
    """See every backward this thread's code starts from now on; returns what stops it."""
    mode = _here.mode
    if mode is None or not _placed(mode):  # none yet, or popped by a context that it outlived
        mode = _here.mode = _Mode()
        _push_mode(mode)
    key = _next[0] = _next[0] + 1
    mode.listeners[key] = listener

    @critical
    def stop() -> None:
        if mode.listeners.pop(key, None) is None or mode.listeners:
            return
        if threading.get_ident() == mode.thread:  # another thread's stack is not ours to change
            _drop(mode)
    return stop


def _placed(mode: _Mode) -> bool:
    held = _here.held
    return held is not None and held[1] is mode or mode in _get_current_function_mode_stack()


def _drop(mode: _Mode) -> None:
    """Take the mode out of this thread's stack, wherever it is (others keep their order)."""
    if _here.held is not None and _here.held[1] is mode:
        _here.held = None
    if _here.mode is mode:
        _here.mode = None
    if mode not in _get_current_function_mode_stack():
        return
    above = []
    while (top := _pop_mode()) is not mode:
        above.append(top)
    for m in reversed(above):
        _push_mode(m)


@critical
def suspend(key: Any) -> None:
    """Take this thread's mode off the top of the stack until `resume(key)` (a forward or an
    optimizer step starts). Inside another key's suspension nothing changes; the same key
    again, or any key while an optimizer's step holds it, means that end never ran (an
    exception skips a step's post hooks, a KeyboardInterrupt a forward's end hooks; a step
    that runs forwards inside, given a closure, is never suspended)."""
    held = _here.held
    if held is not None:
        if held[0] is not key and not isinstance(held[0], torch.optim.Optimizer):
            return
        resume(held[0])
    mode = _here.mode
    if mode is not None and mode.listeners and _get_current_function_mode() is mode:
        _here.held = (key, _pop_mode())


@critical
def resume(key: Any) -> None:
    """Put back what `suspend(key)` took (nothing, if it took nothing)."""
    held = _here.held
    if held is None or held[0] is not key:
        return
    _here.held = None
    if held[1].listeners:
        _push_mode(held[1])
    elif _here.mode is held[1]:
        _here.mode = None


@critical
def release() -> None:
    """Whatever this thread holds suspended goes back (an owner closing)."""
    if _here.held is not None:
        resume(_here.held[0])


def runs_inside(args: tuple, kwargs: dict) -> bool:
    """An optimizer step given a closure runs the forward and backward inside it (LBFGS,
    Lightning's automatic optimization): the mode stays on the stack through that step.
    `args` as a step hook gets them: the optimizer first."""
    return len(args) > 1 and callable(args[1]) or callable(kwargs.get("closure"))


def _suspend_hook(owner: Any, *_: Any) -> None:
    suspend(owner)


def _suspend_step(optimizer: Any, args: tuple, kwargs: dict) -> None:
    if not runs_inside(args, kwargs):
        suspend(optimizer)


def _resume_hook(owner: Any, *_: Any) -> None:
    resume(owner)


@critical
def _hook_everything() -> list[Any]:
    """Global hooks that suspend the mode through each outermost forward and every step."""
    from torch.nn.modules.module import (
        register_module_forward_hook,
        register_module_forward_pre_hook,
    )
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    handles = []
    try:
        handles.append(register_module_forward_pre_hook(_suspend_hook))
        handles.append(register_module_forward_hook(_resume_hook, always_call=True))
        handles.append(register_optimizer_step_pre_hook(_suspend_step))
        handles.append(register_optimizer_step_post_hook(_resume_hook))
    except BaseException:
        _unhook(handles)
        raise
    return handles


@critical
def _unhook(handles: list[Any]) -> None:
    while handles:
        handles.pop().remove()
    release()


def seen_everywhere(listener: Listener) -> Guard:
    """A context in which every backward this thread's code starts runs inside
    listener(call, roots)'s context, the mode suspended in every forward and optimizer step."""
    def enter() -> tuple[list[Any], Callable[[], None]]:
        handles = _hook_everything()
        try:
            return handles, listen(listener)
        except BaseException:
            _unhook(handles)
            raise

    def exit(state: tuple[list[Any], Callable[[], None]]) -> None:
        handles, stop = state
        try:
            _unhook(handles)
        finally:
            stop()

    return Guard(enter, exit)
