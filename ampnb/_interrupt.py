"""Set-up and restore code that an interrupt cannot cut in half.

Jupyter's "interrupt kernel" sends SIGINT, which Python turns into a KeyboardInterrupt at
whatever line runs next. `deferred()` holds it back while a few lines that change or restore
global state run, and raises it right after them; `Guard` builds an enter/exit pair on it whose
enter either completes or is undone, and whose exit always completes.
Only the main thread receives signals; elsewhere both are plain sections.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

_pending: list[int] = []  # SIGINTs that arrived while deferred


def _hold(signum: int, frame: Any) -> None:
    """SIGINT handler while deferred: remember the interrupt, raise it at the end."""
    _pending.append(signum)


def deferring() -> bool:
    """True while a deferred() section holds SIGINT back."""
    return signal.getsignal(signal.SIGINT) is _hold


class deferred:  # noqa: N801 - used like a function: `with deferred():`
    """`with deferred():` delays a SIGINT that arrives inside the block to its end."""

    __slots__ = ("previous",)

    def __enter__(self) -> deferred:
        self.previous = None
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, _hold)
        return self

    def __exit__(self, *exc: object) -> None:
        previous = self.previous
        if previous is None or previous is _hold:  # not main thread, or nested: outer raises
            return
        signal.signal(signal.SIGINT, previous)
        if _pending:
            _pending.clear()
            if callable(previous):
                previous(signal.SIGINT, sys._getframe())  # default_int_handler raises
            else:
                raise KeyboardInterrupt


class Guard:
    """A context manager from enter() -> state and exit(state), safe against interrupts.

    An interrupt during enter() undoes what enter() did before it is raised; exit() always
    runs to its end (an interrupt during it is raised afterwards).
    """

    __slots__ = ("_enter", "_exit", "_state", "_entered")

    def __init__(self, enter: Callable[[], Any], exit: Callable[[Any], None]) -> None:
        self._enter, self._exit, self._entered = enter, exit, False

    def __enter__(self) -> Any:
        try:
            with deferred():
                self._state = self._enter()
                self._entered = True
        except KeyboardInterrupt:
            if self._entered:  # enter() finished; the interrupt came at its end: undo it
                self._entered = False
                with deferred():
                    self._exit(self._state)
            raise
        return self._state

    def __exit__(self, *exc: object) -> None:
        if self._entered:
            with deferred():
                self._entered = False
                self._exit(self._state)
