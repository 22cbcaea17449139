"""Process ids on Linux (/proc), without psutil: alive, descendants, and a tree kill."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) from /proc/PID/stat, or None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the name may hold spaces and ')'
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    """True while pid runs (a zombie, dead but not yet reaped, counts as gone)."""
    if Path("/proc").is_dir():
        found = _stat(pid)
        return found is not None and found[0] not in ("Z", "X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def descendants(pid: int) -> list[int]:
    """Every live process below pid (children, grandchildren, ...) found in /proc."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if entry.name.isdigit() and (found := _stat(int(entry.name))) is not None:
            parents.setdefault(found[1], []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), ()):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(pid: int, below: bool = True, extra: tuple[int, ...] = ()) -> None:
    """SIGKILL the process group pid leads, pid and everything below it (if below), and `extra`."""
    targets = [pid, *descendants(pid)] if below else []
    try:
        os.killpg(pid, signal.SIGKILL)  # pid leads its own session: the agent and its ranks
    except (ProcessLookupError, PermissionError):
        pass
    for p in [*targets, *extra]:
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def wait_gone(pids: list[int], seconds: float = 5.0) -> list[int]:
    """Wait until every pid is gone; returns those still alive after `seconds`."""
    end = time.monotonic() + seconds
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < end:
        time.sleep(0.02)
        left = [p for p in left if alive(p)]
    return left
