"""One watch per log_dir: an owner file made by an exclusive create (O_EXCL), removed at close().

Two watches on one log_dir, in one process or in two, race to create the same file; the operating
system lets exactly one do it, so two runs' records are never merged into one log. The file says
who owns the folder (process id, host, start time). A watch that was never closed because its
process died (killed, the kernel restarted) left its file behind: on the same host, a process id
that no longer runs marks it stale, and the next watch takes the folder over. One from another
host, or whose process id runs again, is refused naming the file to delete.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path

LOCK_NAME = "watch.lock"


def _me() -> str:
    return json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                       "started": time.strftime("%Y-%m-%d %H:%M:%S"), "token": uuid.uuid4().hex})


def _read(lock: Path) -> str:
    with contextlib.suppress(OSError):
        return lock.read_text(encoding="utf-8")
    return ""


def _owner(text: str) -> dict:
    """The owner a lock file names ({} while it is being written, or when it is not ours)."""
    try:
        found = json.loads(text)
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def _dead(owner: dict) -> bool:
    """The owner is a process of this host that no longer runs (its watch was never closed)."""
    pid = owner.get("pid")
    if (os.name == "nt" or owner.get("host") != socket.gethostname()  # os.kill ends it there
            or isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0 or pid == os.getpid()):
        return False
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return True
    except OSError:  # it exists (another user's)
        return False
    return False


def _take_over(lock: Path, seen: str) -> None:
    """Remove a stale lock, unless another process is at it or it changed since it was read:
    a second O_EXCL file makes the check-and-remove one process's at a time."""
    breaker = lock.with_name(LOCK_NAME + ".break")
    try:
        fd = os.open(breaker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return
    try:
        if _read(lock) == seen:
            lock.unlink()
    finally:
        os.close(fd)
        breaker.unlink()


def _refusal(shown: str, lock: Path, text: str) -> ValueError:
    o = _owner(text)
    who = (f"pid {o.get('pid')} on {o.get('host')}, since {o.get('started')}"
           + (", this process" if o.get("pid") == os.getpid() else "") if o else "owner unknown")
    return ValueError(f"log_dir={shown} is in use by another watch ({who}); allowed: a log_dir "
                      f"no open watch writes to (close() that watch; if no process uses it, "
                      f"delete {lock})")


def holds_a_run(shown: str, log_file: Path) -> ValueError:
    """The error for a log_dir whose log already holds a run's records."""
    return ValueError(f"log_dir={shown} already holds a run ({log_file}); allowed: a new or "
                      "empty folder, one run per log_dir, so that runs are never merged")


def claim(log_file: Path, shown: str) -> Callable[[], None]:
    """Own the folder of `log_file` (a ValueError naming its owner if another watch does);
    returns what releases it."""
    folder = log_file.parent
    folder.mkdir(parents=True, exist_ok=True)  # checked writable when the watch started
    lock, me = folder / LOCK_NAME, _me()
    for _ in range(2):  # the second time after a stale lock was removed
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            seen = _read(lock)
            if not _dead(_owner(seen)):
                raise _refusal(shown, lock, seen) from None
            _take_over(lock, seen)
            continue
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(me)
        except BaseException:  # a full disk: no half-written lock left to keep others out
            lock.unlink()
            raise

        def release() -> None:
            if _read(lock) == me:  # still ours
                with contextlib.suppress(OSError):
                    lock.unlink()
        if log_file.exists():  # a run that closed between the check and now
            release()
            raise holds_a_run(shown, log_file)
        return release
    raise _refusal(shown, lock, _read(lock))
