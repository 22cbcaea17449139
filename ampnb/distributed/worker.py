"""One rank: run the cell that the launcher sent, write its value or traceback to the job folder.

Runs in a process started by torch's elastic agent (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR
and MASTER_PORT are set), which forks the cell's process and watches it: only a parent learns
how a process ended, so a rank that dies without a Python exception (os._exit, a signal) is
named with its exit code or signal, and when. The cell runs in `ampnb.step.cell_context` under
the notebook's settings, with the models it uses found by name as `%%amp` finds them: one
process's rules. Output goes to `rank{r}.log` at the file-descriptor level, so C++ warnings and
output printed before a kill come back too.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import datetime
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing import _prctl_pr_set_pdeathsig

from ampnb._kernels import without_override_frames
from ampnb._tree import map_tensors
from ampnb.comparison.snapshot import cell_models
from ampnb.device import restore_tf32, tf32_setting
from ampnb.distributed._ship import unpack
from ampnb.fp16_kernels import fp16_kernels_choice
from ampnb.precision import Precision
from ampnb.step import StepSettings, cell_context


def _redirect(path: Path) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)


def _user_traceback(error: BaseException, files: dict[str, str]) -> str:
    """The traceback from the first frame of the cell (or of a function it sent) on."""
    tb = without_override_frames(error).__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename not in files:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(error), error, tb or error.__traceback__))


def _portable(value: Any) -> Any:
    """The value as the notebook can load it: tensors on the CPU; else its repr."""
    try:
        value = map_tensors(lambda t: t.detach().cpu(), value)
        pickle.loads(pickle.dumps(value))
        return value
    except Exception:
        return Unsent(repr(value))


class Unsent(str):
    """The repr of a value a rank returned that could not be sent back."""

    def __repr__(self) -> str:
        return str(self)


def _device(kind: str, local_rank: int) -> torch.device:
    if kind == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _names(*sources: str | None) -> set[str]:
    """The names a cell's code uses (as `%%amp` collects them from the cell's syntax tree)."""
    return {n.id for src in sources if src for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Name)}


def _context(payload: Any, ns: dict[str, Any]) -> contextlib.AbstractContextManager:
    """The cell's `cell_context` on this rank (its device, the notebook's settings and flags)."""
    r = payload.settings
    if r is None:
        return contextlib.nullcontext()
    if r.flags is not None:
        restore_tf32(r.flags)  # the notebook's TF32 flags: what "as is" meant there
    kernels = None if r.fp16_kernels is None else fp16_kernels_choice(r.fp16_kernels)
    s = StepSettings(Precision.of(r.mode, device=ns["device"]), tf32_setting(r.tf32), kernels,
                     r.keep_fp32)
    ns["mode"] = s.mode
    return cell_context(s, cell_models(s.keep_fp32, ns, _names(payload.body, payload.last)))


def _run(job: Any, ns: dict[str, Any]) -> Any:
    payload = job["payload"]
    unpack(payload, ns)
    body = compile(payload.body, payload.filename, "exec")
    last = None if payload.last is None else compile(payload.last, payload.filename, "eval")
    with _context(payload, ns):  # the one context a %%amp cell runs in, as on one process
        exec(body, ns)
        return None if last is None else eval(last, ns)


_DISTRIBUTED = str(Path(dist.__file__).parent) + os.sep


def _from_distributed(error: BaseException) -> bool:
    """Whether the error was raised inside torch.distributed (a collective, the rendezvous, the
    agent's stop): what a rank gets when another rank failed, so it is no cause of its own."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename.startswith(_DISTRIBUTED)


def _failure(error: BaseException, payload: Any) -> dict[str, Any]:
    return {"value": None, "error": _user_traceback(error, payload.files),
            "in_distributed": _from_distributed(error),
            "failed_at": time.monotonic()}  # one clock for all ranks: which failed first


def _write(folder: Path, rank: int, result: dict[str, Any]) -> None:
    (folder / f"rank{rank}.tmp").write_bytes(pickle.dumps(result))
    os.replace(folder / f"rank{rank}.tmp", folder / f"rank{rank}.result")


def _cell_process(folder: Path, rank: int) -> int:
    """Run the cell on this rank; write its value or traceback; the exit code."""
    _redirect(folder / f"rank{rank}.log")
    torch.set_num_threads(1)  # one thread per rank: ranks share the machine's cores
    job = pickle.loads((folder / "job.pkl").read_bytes())
    os.environ["TMPDIR"] = job["tmpdir"]  # the notebook's: the agent's own is a private one
    tempfile.tempdir = None
    device = _device(job["device"], int(os.environ["LOCAL_RANK"]))
    module = types.ModuleType("__main__")  # what was sent from the kernel's __main__ lands here
    sys.modules["__main__"] = module
    ns = module.__dict__
    ns.update(__builtins__=builtins, rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
              device=device)
    result: dict[str, Any] = {"value": None, "error": None}
    try:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=job["timeout"]))
        result["value"] = _portable(_run(job, ns))
    except SystemExit as e:  # sys.exit() / sys.exit(0): a clean end, the value None
        if e.code not in (None, 0):
            result = _failure(e, job["payload"])
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the notebook
        result = _failure(e, job["payload"])
    _write(folder, rank, result)
    sys.stdout.flush()
    sys.stderr.flush()
    if result["error"] is not None:
        return 1  # the agent then stops the other ranks (they may wait in a collective)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


# Why a process may get a signal, for a rank that ended by one.
_SIGNAL_HINTS = {
    signal.SIGKILL: "os.kill, or the system when memory runs out",
    signal.SIGABRT: "os.abort(), or a failed check in native code",
    signal.SIGSEGV: "a crash in native code",
    signal.SIGBUS: "a crash in native code",
}


def ended_how(status: int) -> str:
    """One line saying how a process ended without a Python exception (a wait status)."""
    code = os.waitstatus_to_exitcode(status)
    if code >= 0:
        return (f"RankDied: the process ended with exit code {code} and no Python exception "
                "(os._exit, or native code ending the process)")
    sig = signal.Signals(-code)
    hint = _SIGNAL_HINTS.get(sig)
    return (f"RankDied: the process was killed by {sig.name} ({signal.strsignal(sig)}) without "
            "a Python exception" + (f"; {sig.name} comes from {hint}" if hint else ""))


_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # the agent's "stop"


def _watch(folder: Path, rank: int, child: int) -> int:
    """Wait for the cell's process, passing on the agent's stop; note how it ended if it
    reported nothing itself. The exit code of this rank."""
    stopped: list[int] = []

    def forward(signum: int, frame: Any) -> None:
        stopped.append(signum)
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signum)

    for sig in _FORWARDED:
        signal.signal(sig, forward)
    (folder / f"rank{rank}.pid").write_text(f"{child} {os.getpid()}")
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED)
    status = os.waitpid(child, 0)[1]
    ended = time.monotonic()
    if (folder / f"rank{rank}.result").exists():
        return 0 if os.waitstatus_to_exitcode(status) == 0 else 1
    if os.waitstatus_to_exitcode(status) == 0:  # os._exit(0): ended cleanly, nothing returned
        _write(folder, rank, {"value": None, "error": None})
        return 0
    if not stopped:  # the agent stopped it (as it stops every rank once one failed): no cause
        _write(folder, rank, {"value": None, "error": ended_how(status), "failed_at": ended})
    return 1


def main(job_dir: str) -> None:
    """Entry point of each rank (a function, so the agent can fork it without a new torch import).

    The cell runs in a child process that this one watches; both end when the rank ends.
    """
    folder = Path(job_dir)
    rank, watcher = int(os.environ["RANK"]), os.getpid()
    signal.pthread_sigmask(signal.SIG_BLOCK, _FORWARDED)  # until the watcher's handlers are set
    child = os.fork()
    if child == 0:
        code = 1
        try:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED)
            _prctl_pr_set_pdeathsig(signal.SIGKILL)  # never outlives its watcher
            if os.getppid() != watcher:  # it ended before that was set
                return
            code = _cell_process(folder, rank)
        except BaseException:  # noqa: BLE001 - ampnb's own failure, before the cell ran
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    code = _watch(folder, rank, child)
    if code:
        os._exit(code)  # the agent sees the rank failed and stops the others
