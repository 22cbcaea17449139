"""Each backward the user's code starts (`Tensor.backward`, `torch.autograd.backward`,
`torch.autograd.grad`), seen through a `TorchFunctionMode`: torch's public way to see calls
to its functions. Nothing in torch or in the user's objects is replaced.

Where it sits: at the *bottom* of the mode stack of the thread that runs the user's code, and
only while a listener of that thread wants it (`arm`): a `%%amp` cell for its body (the
backward runs with autocast off), a watch from its model's forward's end to the next forward or
optimizer step (the loss). Every mode the user enters lies above it, so their exits, in whatever
order they come, pop only their own (`TorchFunctionMode.__exit__` pops the top, whatever it is);
ampnb takes its mode out from wherever it lies, the user's modes keeping their order.

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
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import (
    TorchFunctionMode,
    _get_current_function_mode_stack,
    _pop_mode,
    _push_mode,
)

from ampnb import _interrupt
from ampnb._interrupt import Guard, critical
from ampnb._interrupt import _pending as _held

GRAD = torch.autograd.grad
_TENSOR_BACKWARD, _BACKWARD = torch.Tensor.backward, torch.autograd.backward

# (the call: Tensor.backward, autograd.backward or GRAD; its roots) -> a context the backward runs in (None: nothing)
Listener = Callable[[Callable[..., Any], list[torch.Tensor]], contextlib.AbstractContextManager
                    | None]


class _Here(threading.local):
    """This thread's mode and who wants it (each thread has its own mode stack)."""

    def __init__(self) -> None:
        self.mode: _Mode | None = None    # the mode while it is on this thread's stack
        self.armed: dict[Any, Listener] = {}  # the listeners that want this thread's backwards
        self.held: Any = None             # the forward or step that suspended it (None: none)
        self.inside = False               # a backward the mode saw runs now: it is stashed


_here = _Here()


def roots(func: Callable[..., Any], args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The floating tensors a backward call starts from (detached)."""
    first = args[0] if args else kwargs.get("outputs" if func is GRAD else "tensors",
                                             kwargs.get("self"))
    found = [first] if isinstance(first, torch.Tensor) else list(first or ())
    return [t.detach() for t in found if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _warn(e: Exception) -> None:
    warnings.warn(f"ampnb could not follow a backward ({type(e).__name__}: {e}); the backward "
                  "runs as without ampnb", RuntimeWarning, stacklevel=4)


def _contexts(stack: contextlib.ExitStack, func: Callable[..., Any],
              found: list[torch.Tensor]) -> None:
    """Enter each armed listener's context; one that fails is a warning, never an error."""
    for listener in list(_here.armed.values()):
        try:
            context = listener(func, found)
            if context is not None:
                stack.enter_context(context)
        except Exception as e:  # an instrument never raises into training
            _warn(e)


class _Mode(TorchFunctionMode):
    """Runs each backward call inside its thread's listeners' contexts; every other call as it is.

    Critical: torch calls it from its own restore code too (`no_grad.__exit__` setting grad mode
    back goes through the modes), where an interrupt in this frame would cut that restore; one
    that arrives while it runs (a backward included) is raised as it returns."""

    @critical
    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        __tracebackhide__ = True  # noqa: F841 - IPython shows the user's frames, not this one
        try:
            # nearly every call passes as cheaply as can be (identity: hashing a bound method
            # of a tensor would call Tensor.__hash__)
            if func is not _TENSOR_BACKWARD and func is not _BACKWARD and func is not GRAD:
                return func(*args, **kwargs) if kwargs else func(*args)
            return _seen(func, args, kwargs or {})
        finally:
            if _held:
                _interrupt.raise_held(sys._getframe(1))


def _seen(func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """A backward call: run inside this thread's listeners' contexts."""
    __tracebackhide__ = True  # noqa: F841
    if not _here.armed or _here.inside:
        return func(*args, **kwargs)
    with contextlib.ExitStack() as stack:
        _contexts(stack, func, roots(func, args, kwargs))
        # a Guard: an interrupt landing as the flag is set or cleared cannot leave it set (the
        # stack would then never be put right again in this thread)
        with Guard(_inside, _outside):
            return func(*args, **kwargs)


_POP_CODE = torch.overrides._pop_mode_temporarily.__wrapped__.__code__


def _putting_back(frame: Any) -> bool:
    """torch puts a mode back after its __torch_function__ in `_pop_mode_temporarily`'s finally,
    run by contextlib's __exit__: an interrupt there would leave the generator to put ampnb's
    mode back whenever it is collected, on whatever stack is there then."""
    gen = frame.f_locals.get("self") if frame.f_code is _EXIT_CODE else None
    if gen is not None:
        gen = getattr(gen, "gen", None)
        frame = getattr(gen, "gi_frame", None) if getattr(gen, "gi_code", None) is _POP_CODE \
            else None
    return frame is not None and frame.f_code is _POP_CODE \
        and isinstance(frame.f_locals.get("old"), _Mode)


_EXIT_CODE = contextlib._GeneratorContextManager.__exit__.__code__
_interrupt._HOLD_IN.append(_putting_back)


def _inside() -> None:
    _here.inside = True


def _outside(_: None) -> None:
    _here.inside = False


def _placed(mode: _Mode | None) -> bool:
    return mode is not None and mode in _get_current_function_mode_stack()


def _insert(mode: _Mode) -> None:
    """Put the mode at the bottom of this thread's stack, below every mode of the user's."""
    above = []
    while _get_current_function_mode_stack():
        above.append(_pop_mode())
    _push_mode(mode)
    while above:
        _push_mode(above.pop())


def _drop(mode: _Mode) -> None:
    """Take the mode out of this thread's stack, wherever it is (others keep their order)."""
    if mode not in _get_current_function_mode_stack():
        return
    above = []
    while (top := _pop_mode()) is not mode:
        above.append(top)
    while above:
        _push_mode(above.pop())


@critical
def _sync() -> None:
    """The mode on this thread's stack exactly when a listener wants it and no forward or step
    holds it. Nothing moves while a backward it dispatched runs (torch holds it aside then)."""
    if _here.inside:
        return
    want = bool(_here.armed) and _here.held is None
    mode = _here.mode
    if want and not _placed(mode):
        _here.mode = mode = _Mode()
        _insert(mode)
    elif not want and mode is not None:
        _here.mode = None
        _drop(mode)


@critical
def arm(key: Any, listener: Listener) -> None:
    """From now on, each backward this thread's code starts runs inside listener's context."""
    _here.armed[key] = listener
    _sync()


@critical
def disarm(key: Any) -> None:
    """This thread's backwards no longer go to key's listener (the mode leaves with the last)."""
    if _here.armed.pop(key, None) is not None:
        _sync()


@critical
def suspend(key: Any) -> None:
    """Take this thread's mode off the stack until `resume(key)` (a forward or an optimizer step
    starts). Inside another key's suspension nothing changes; the same key again, or any key
    while an optimizer's step holds it, means that end never ran (an exception skips a step's
    post hooks, a KeyboardInterrupt a forward's end hooks; a step that runs forwards inside,
    given a closure, is never suspended)."""
    held = _here.held
    if held is not None:
        if held is not key and not isinstance(held, torch.optim.Optimizer):
            return
        resume(held)
    if _here.armed:
        _here.held = key
        _sync()


@critical
def resume(key: Any) -> None:
    """Put back what `suspend(key)` took (nothing, if it took nothing)."""
    if _here.held is None or _here.held is not key:
        return
    _here.held = None
    _sync()


@critical
def release() -> None:
    """Whatever this thread holds suspended goes back (an owner closing)."""
    if _here.held is not None:
        resume(_here.held)


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
    key = object()

    def enter() -> list[Any]:
        handles = _hook_everything()
        try:
            arm(key, listener)
        except BaseException:
            _unhook(handles)
            raise
        return handles

    def exit(handles: list[Any]) -> None:
        try:
            _unhook(handles)
        finally:
            disarm(key)

    return Guard(enter, exit)
