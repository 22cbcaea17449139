"""Set-up and restore code that an interrupt cannot cut in half.

Jupyter's "interrupt kernel" sends SIGINT, which Python turns into a KeyboardInterrupt at
whatever line runs next. While any `Guard` or `deferred()` section is active, ampnb's SIGINT
handler (`_hold`) decides where the interrupt may land: inside set-up or restore code (a
Guard's enter/exit and what they call, a `deferred()` block) it is held and raised as soon as
that code is done (so are the few spots in ampnb's code where a line tracer, but never a real
signal, can stop outside a block's cleanup: see `_unsafe_offsets`); anywhere else — the user's
own code above all — it is raised at once, as without ampnb. `_sections` counts the sections
that keep the handler installed and those whose set-up/restore code runs now. Only the main
thread receives signals and installs the handler; a Guard's enter/exit on another thread still
counts as running set-up/restore code, so the main thread holds an interrupt meanwhile.

ampnb runs no Python code in finalizers (`__del__`, weakref or `weakref.finalize` callbacks):
Python discards an exception raised there, so an interrupt landing in one would be lost. Work
done when an object dies is noted by a builtin (a weakref callback that is a list's `append`)
and finished by ordinary code later (the memory meter settles frees when it is next used).
"""

from __future__ import annotations

import _signal  # the C functions behind `signal`: its Python wrappers cost ~12 us a call
import dis
import functools
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

_PACKAGE = str(Path(__file__).resolve().parent)
_CRITICAL: set[CodeType] = set()  # code that must run to its end once started
_pending: list[int] = []          # SIGINTs held back, raised when the critical code is done
# frame -> whether an interrupt there must be held: torch's own frames that put an ampnb object
# back (registered by its owner, `ampnb.backwards`), where ampnb's code cannot be marked critical
_HOLD_IN: list[Callable[[FrameType], bool]] = []


class _Sections:
    """How many ampnb sections are active (plain slots: read and bumped on every Guard)."""

    __slots__ = ("installed", "holding")

    def __init__(self) -> None:
        self.installed = 0  # sections that keep ampnb's SIGINT handler in place
        self.holding = 0    # set-up/restore code and deferred() blocks running now: SIGINT held


_sections = _Sections()
_previous: list[Any] = []         # the handler ampnb's replaced (restored when the last ends)


def critical(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a function (and so every call it makes) as code an interrupt must not cut."""
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    if code is not None:
        _CRITICAL.add(code)
    return fn


@functools.cache
def _unsafe_offsets(code: CodeType) -> frozenset[int]:
    """Where a line can start but a real signal never lands, and an exception there skips cleanup.

    The start of leaving a `with` block (three Nones pushed for __exit__, before the call, and
    the SWAP before them that carries a `return`'s value past the exit) and a `try:` line's NOP
    lie outside the exception table: an interrupt raised there would skip the block's exit.
    CPython only runs signal handlers at calls, function entries and backward jumps, never at
    these; a line tracer (the interrupt sweep) can stop at them, so they hold.
    """
    ins = list(dis.get_instructions(code))
    exits = set()
    for k, (a, b, c) in enumerate(zip(ins, ins[1:], ins[2:])):
        if a.opname == b.opname == c.opname == "LOAD_CONST" \
                and a.argval is b.argval is c.argval is None:
            exits.add(a.offset)
            if k and ins[k - 1].opname == "SWAP":
                exits.add(ins[k - 1].offset)
    return frozenset(exits | {i.offset for i in ins if i.opname == "NOP"})


def _must_hold(frame: FrameType | None) -> bool:
    if _sections.holding:
        return True
    if frame is not None and frame.f_code.co_filename.startswith(_PACKAGE) \
            and frame.f_lasti in _unsafe_offsets(frame.f_code):
        return True
    while frame is not None:
        if frame.f_code in _CRITICAL or any(hold(frame) for hold in _HOLD_IN):
            return True
        frame = frame.f_back
    return False


def _hold(signum: int, frame: FrameType | None) -> None:
    """ampnb's SIGINT handler: hold the interrupt inside critical code, else raise it now."""
    if _must_hold(frame):
        _pending.append(signum)
        return
    _raise(frame)


def _raise(frame: FrameType | None) -> None:
    previous = _previous[0] if _previous else signal.default_int_handler
    if callable(previous) and previous is not _hold:
        previous(signal.SIGINT, frame)  # default_int_handler raises KeyboardInterrupt
    raise KeyboardInterrupt


def deferring() -> bool:
    """True while ampnb's handler is installed (some Guard or deferred() section is active)."""
    return _signal.getsignal(signal.SIGINT) is _hold


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@critical
def _install() -> bool:
    if not _main_thread():
        return False
    if _sections.installed == 0:
        _previous[:] = [_signal.signal(signal.SIGINT, _hold)]
    _sections.installed += 1
    return True


@critical
def _uninstall() -> None:
    _sections.installed -= 1
    if _sections.installed == 0:
        _signal.signal(signal.SIGINT, _previous.pop() if _previous else signal.default_int_handler)


def raise_held(frame: FrameType | None) -> None:
    """At the end of a critical function that is not a Guard's (a mode's __torch_function__),
    called from `frame`: raise a held interrupt, unless that frame must hold it too (the code
    that called is critical itself: its Guard raises it)."""
    if _pending and not _must_hold(frame):
        _pending.clear()
        _raise(frame)


def _release() -> None:
    """Raise a held interrupt once no set-up or restore section is running any more."""
    if _pending and not _sections.holding:
        _pending.clear()
        _raise(sys._getframe(1))


class deferred:  # noqa: N801 - used like a function: `with deferred():`
    """`with deferred():` holds a SIGINT that arrives inside the block until its end."""

    __slots__ = ("installed",)

    @critical
    def __enter__(self) -> deferred:
        self.installed = _install()
        if self.installed:
            _sections.holding += 1
        return self

    @critical
    def __exit__(self, *exc: object) -> None:
        if self.installed:
            _sections.holding -= 1
            _uninstall()
        _release()


class Guard:
    """A context manager from enter() -> state and exit(state), safe against interrupts.

    An interrupt during enter() undoes what enter() did before it is raised; exit() always
    runs to its end (an interrupt during it is raised afterwards). While the body runs,
    ampnb's handler stays installed, so that the entry into exit() is itself protected.
    """

    __slots__ = ("_enter", "_exit", "_state", "_entered", "_installed")

    def __init__(self, enter: Callable[[], Any], exit: Callable[[Any], None]) -> None:
        self._enter, self._exit, self._entered = critical(enter), critical(exit), False

    @critical
    def __enter__(self) -> Any:
        self._installed = _install()
        _sections.holding += 1
        try:
            self._state = self._enter()
            self._entered = True
        except BaseException:
            _sections.holding -= 1
            if self._installed:
                _uninstall()  # enter() failed before it finished: nothing to restore
            raise
        _sections.holding -= 1
        if _pending and not _sections.holding:  # interrupted during enter(): undo, then raise
            self.__exit__(None, None, None)
        return self._state

    @critical
    def apply(self) -> Any:
        """enter() alone, for a change that is kept (an interrupt during it undoes it).

        Unlike `with`, ampnb's SIGINT handler is not kept installed afterwards; a later
        `__exit__` (e.g. a detach) still restores, as critical code.
        """
        _sections.holding += 1
        try:
            state = self.__enter__()
            if self._installed:
                self._installed = False
                _uninstall()
        finally:
            _sections.holding -= 1
        if _pending and not _sections.holding:
            self.__exit__(None, None, None)
        return state

    @critical
    def __exit__(self, *exc: object) -> None:
        _sections.holding += 1
        try:
            if self._entered:
                self._entered = False
                self._exit(self._state)
        finally:
            _sections.holding -= 1
            if self._installed:
                self._installed = False
                _uninstall()
        _release()
