"""Notebook budgets: each tutorial under nbval, its wall time and its kernel's peak memory."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks._common import Result

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
SUITE_GOAL_S = 5 * 60    # issue 7: the whole nbval suite within 5 minutes on 2 CPU cores
PEAK_GOAL_B = 1.5e9      # issue 7: each notebook's peak memory within 1.5 GB (Binder has 1-2 GB)
POLL_S = 0.1             # VmHWM is a high-water mark, so polling only has to see each process once


@dataclass(frozen=True)
class NotebookRun:
    """One notebook under nbval: outcome, seconds, peak RSS of its kernel, and pytest's summary."""

    name: str
    passed: bool
    seconds: float
    kernel_peak: int | None   # bytes; None when the kernel was never seen in /proc
    tree_peak: int            # bytes; largest process in the tree (getrusage via wait4)
    summary: str


def nbval_command(path: Path) -> list[str]:
    """The Makefile's nbval command, for one notebook."""
    return [sys.executable, "-m", "pytest", "-q", "--nbval-lax", "--nbval-sanitize-with",
            str(NOTEBOOKS / "src" / "sanitize.cfg"), "-p", "no:cacheprovider", str(path)]


def _parents() -> dict[int, int]:
    """pid -> parent pid for every process in /proc."""
    found = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:  # the process ended while we looked
                continue
            # The command name may hold spaces or parentheses: the ppid follows the last ')'.
            found[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return found


def _descendants(root: int) -> list[int]:
    parents, tree, frontier = _parents(), [], [root]
    while frontier:
        pid = frontier.pop()
        children = [p for p, pp in parents.items() if pp == pid]
        tree.extend(children)
        frontier.extend(children)
    return tree


def _kernel_hwm(root: int) -> int | None:
    """Peak RSS (VmHWM) in bytes of the ipykernel process under root, if it is running."""
    for pid in _descendants(root):
        try:
            if b"ipykernel" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            continue
    return None


def run_notebook(path: Path) -> NotebookRun:
    """Run one notebook under nbval in a subprocess and measure it."""
    import subprocess

    with tempfile.TemporaryFile() as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(nbval_command(path), cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT)
        kernel_peak = None
        while True:
            # wait4 (not Popen.wait) also returns the child's rusage: its ru_maxrss covers
            # every descendant it reaped, the kernel included.
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            seen = _kernel_hwm(proc.pid)
            if seen is not None:
                kernel_peak = max(kernel_peak or 0, seen)
            time.sleep(POLL_S)
        seconds = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        lines = log.read().decode(errors="replace").strip().splitlines()
    return NotebookRun(path.name, proc.returncode == 0, seconds, kernel_peak,
                       usage.ru_maxrss * 1024, lines[-1] if lines else "")


def _row(r: NotebookRun) -> Result:
    peak = r.kernel_peak if r.kernel_peak is not None else r.tree_peak
    source = "kernel" if r.kernel_peak is not None else "largest process"
    figure = (f"{r.seconds:.1f} s, {source} peak RSS {peak / 2**20:.0f} MiB; "
              f"nbval: {r.summary}")
    return Result(f"notebook {r.name}: peak memory", figure, peak / 1e9, "<= 1.5 GB",
                  r.passed and peak <= PEAK_GOAL_B)


def run() -> list[Result]:
    runs = [run_notebook(p) for p in sorted(NOTEBOOKS.glob("[0-9]*.ipynb"))]
    total = sum(r.seconds for r in runs)
    failed = [r.name for r in runs if not r.passed]
    figure = (f"{total:.0f} s for {len(runs)} notebooks, one pytest process each"
              + (f"; FAILED: {', '.join(failed)}" if failed else ", all passed"))
    suite = Result("nbval suite: total wall time (2 CPU cores)", figure, total / 60,
                   "<= 5 min", not failed and total <= SUITE_GOAL_S)
    return [*map(_row, runs), suite]
