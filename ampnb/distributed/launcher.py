"""Run a cell (or a function) on N local ranks with torch's elastic launcher, and end them all."""

from __future__ import annotations

import math
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ampnb._interrupt import Guard
from ampnb.display import Table, TableView
from ampnb.distributed import _procs
from ampnb.distributed._ship import Payload

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # so the ranks import this ampnb


@dataclass(frozen=True)
class RankResult:
    """What one rank printed and returned, or its traceback."""

    rank: int
    pid: int | None
    output: str
    value: Any
    error: str | None
    status: str  # 'ok', 'failed', 'stopped' (ended by the launcher), 'timeout'
    failed_at: float | None = None  # time.monotonic() on the rank when it failed or died
    in_distributed: bool = False  # its error came from torch.distributed: a likely consequence


@dataclass(frozen=True, repr=False)
class DistributedRun(TableView):
    """A cell's run on N ranks: each rank's result, and the processes that ran it."""

    nproc: int
    device: str
    mode: str | None
    ranks: tuple[RankResult, ...]
    seconds: float
    pids: tuple[int, ...]  # the agent's, every rank's and their watchers': all ended on return
    agent_log: str = ""

    @property
    def ok(self) -> bool:
        return all(r.status == "ok" for r in self.ranks)

    @property
    def values(self) -> tuple[Any, ...]:
        return tuple(r.value for r in self.ranks)

    def output(self) -> str:
        """Every rank's output, each line labelled with its rank."""
        return "".join(f"[rank {r.rank}] {line}\n" for r in self.ranks
                       for line in r.output.splitlines())

    def table(self) -> Table:
        rows = [(r.rank, r.status, _short(r.value) if r.error is None else _clip(_last_line(r.error)))
                for r in self.ranks]
        cap = f"{self.nproc} ranks on {self.device}" + (f" under {self.mode}" if self.mode else "")
        return Table(("rank", "status", "value / error"), rows, caption=cap)


class RankFailed(RuntimeError):
    """One or more ranks failed or ran out of time; IPython shows each rank's traceback."""

    def __init__(self, run: DistributedRun) -> None:
        bad = _first_failure_first(run.ranks)
        what = "; ".join(f"rank {r.rank}: {_last_line(r.error or r.status)}" for r in bad)
        super().__init__(what or "the ranks did not finish")
        self.run = run

    def _render_traceback_(self) -> list[str]:
        lines = []
        bad = _first_failure_first(self.run.ranks)
        for r in bad:
            after = f", after rank {bad[0].rank} failed" if r is not bad[0] and bad[0].failed_at else ""
            lines += [f"--- rank {r.rank} ({r.status}{after}) ---", *r.error.rstrip().splitlines()]
        later = [str(r.rank) for r in bad[1:] if r.failed_at is not None]
        if later and bad[0].failed_at is not None:
            lines.append(f"rank {bad[0].rank} failed first; the errors of rank(s) "
                         f"{', '.join(later)} came after it (most likely because of it)")
        stopped = [str(r.rank) for r in self.run.ranks if r.status == "stopped"]
        if stopped:
            lines.append(f"rank(s) {', '.join(stopped)} stopped by the launcher; every process ended")
        return lines


def _first_failure_first(ranks: tuple[RankResult, ...]) -> list[RankResult]:
    """The failed and timed-out ranks, the likely cause first: a failure of the rank's own (its
    code's exception, or its process dying) before one inside torch.distributed (a collective
    that lost its peer, the agent's stop), each kind in the order they failed."""
    bad = [r for r in ranks if r.status in ("failed", "timeout") and r.error]
    return sorted(bad, key=lambda r: (r.failed_at is None, r.in_distributed, r.failed_at or 0.0,
                                      r.rank))


def _clip(text: str, width: int = 80) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def _short(value: Any, width: int = 60) -> str:
    return _clip(repr(value).replace("\n", " "), width)


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else text


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cores() -> int:
    """The CPU cores this process may run on (a container's limit, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def check_timeout(timeout: Any, name: str = "--timeout") -> float:
    """timeout as seconds, a finite number above 0 (ValueError says what is allowed)."""
    try:
        seconds = float(timeout)
    except (TypeError, ValueError):
        seconds = math.nan
    if isinstance(timeout, bool) or not 0 < seconds < math.inf:
        raise ValueError(f"{name} must be a number of seconds above 0 (e.g. {name} 60), "
                         f"got {timeout!r}")
    return seconds


def check_nproc(nproc: Any, device: str) -> int:
    """nproc as an int within what the machine has (ValueError says what is allowed)."""
    kind = torch.device(device).type
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"ranks run on cpu (gloo) or cuda (NCCL), got device {device!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError("NCCL needs CUDA, which this machine lacks; --device cpu runs the "
                         "ranks with gloo")
    most = torch.cuda.device_count() if kind == "cuda" else _cores()
    unit = "GPUs" if kind == "cuda" else "CPU cores"
    if isinstance(nproc, bool) or not isinstance(nproc, int) or not 1 <= nproc <= most:
        raise ValueError(f"--nproc must be a whole number from 1 to {most} (the {unit} "
                         f"here), got {nproc!r}")
    return nproc


def _environment(temp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["TMPDIR"] = str(temp)  # the agent's log tree and error files: gone with the job folder
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    if Path("/sys/class/net/lo").exists():
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # ranks talk over loopback only
    env.pop("MPLBACKEND", None)  # the kernel's inline backend is no module in a plain process
    return env


def _start(folder: Path) -> subprocess.Popen:
    temp = folder / "tmp"
    temp.mkdir()
    log = open(folder / "agent.log", "wb")  # noqa: SIM115 - closed by _stop
    try:
        return subprocess.Popen([sys.executable, "-m", "ampnb.distributed.agent", str(folder)],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=_environment(temp), start_new_session=True)
    finally:
        log.close()


def _rank_pids(folder: Path, nproc: int) -> dict[int, tuple[int, int]]:
    """rank -> (the pid that runs its cell, the pid of its watcher), for the ranks started."""
    found = {}
    for r in range(nproc):
        try:
            cell, watcher = map(int, (folder / f"rank{r}.pid").read_text().split())
        except (OSError, ValueError):
            continue
        found[r] = (cell, watcher)
    return found


def _stop(proc: subprocess.Popen, folder: Path, nproc: int) -> None:
    """Kill the agent's session and every rank, then reap the agent."""
    ranks = tuple(p for pair in _rank_pids(folder, nproc).values() for p in pair if _procs.alive(p))
    _procs.kill_tree(proc.pid, below=proc.poll() is None, extra=ranks)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _still_running(output: str, timeout: float) -> str:
    """The error of a rank stopped at the timeout: what it printed last, then why it stopped."""
    last = [ln for ln in output.splitlines() if ln.strip()][-3:]
    said = ["it printed last:", *("    " + ln for ln in last)] if last else ["it printed nothing"]
    return "\n".join([*said, f"TimeoutError: still running after {timeout:g} s (the timeout); "
                                 "every rank was stopped"])


def _collect(folder: Path, nproc: int, timeout: float | None) -> tuple[RankResult, ...]:
    """Each rank's result; timeout: the run was stopped after that many seconds (else None)."""
    pids = {r: cell for r, (cell, _) in _rank_pids(folder, nproc).items()}
    results = []
    for r in range(nproc):
        log = folder / f"rank{r}.log"
        output = log.read_text(errors="replace") if log.exists() else ""
        try:
            got = pickle.loads((folder / f"rank{r}.result").read_bytes())
        except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError):
            got = None
        if got is None:
            status = "stopped" if timeout is None else "timeout"
            error = None if timeout is None else _still_running(output, timeout)
            results.append(RankResult(r, pids.get(r), output, None, error, status))
        else:
            status = "ok" if got["error"] is None else "failed"
            results.append(RankResult(r, pids.get(r), output, got["value"], got["error"], status,
                                      got.get("failed_at"), got.get("in_distributed", False)))
    return tuple(results)


def launch(payload: Payload, nproc: int = 2, device: str = "cpu",
           timeout: float = 600.0) -> DistributedRun:
    """Run the payload on nproc ranks (gloo on CPU, NCCL on CUDA); every process ended on return.

    A timeout or KeyboardInterrupt kills the agent and all ranks; a timeout returns the run
    with the ranks still running marked 'timeout'. Nothing is left in the temp folder.
    """
    nproc = check_nproc(nproc, device)
    timeout = check_timeout(timeout, "timeout")
    kind = torch.device(device).type
    with tempfile.TemporaryDirectory(prefix="ampnb-ranks-") as tmp:
        folder = Path(tmp)
        # The rendezvous' and collectives' own timeouts (whole seconds, within what their clocks
        # hold) end no sooner than ours.
        job = {"payload": payload, "device": kind, "nproc": nproc, "port": free_port(),
               "timeout": min(math.ceil(timeout), 10**7), "tmpdir": tempfile.gettempdir()}
        (folder / "job.pkl").write_bytes(pickle.dumps(job))
        t0, timed_out = time.perf_counter(), False
        # Started all or not at all; ended (agent and ranks) whatever line an interrupt lands on.
        with Guard(lambda: _start(folder), lambda p: _stop(p, folder, nproc)) as proc:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
            pids = (proc.pid, *(p for pair in _rank_pids(folder, nproc).values() for p in pair))
        seconds = time.perf_counter() - t0
        agent_log = (folder / "agent.log").read_text(errors="replace")
        ranks = _collect(folder, nproc, timeout if timed_out else None)
    return DistributedRun(nproc, kind, payload.mode, ranks, seconds, pids, agent_log)
