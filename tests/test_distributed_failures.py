"""%%amp --nproc when a rank dies, exits or hangs: the cause named first, nothing left behind."""

from __future__ import annotations

import os
import tempfile
import time

import pytest
from _magics_kit import shell_with_ampnb
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from ampnb.distributed import RankFailed
from ampnb.distributed._procs import wait_gone
from ampnb.distributed.launcher import DistributedRun, RankResult, _first_failure_first
from ampnb.magics.amp import AmpMagics

ip = pytest.fixture(shell_with_ampnb)


@pytest.fixture
def temp_folder(tmp_path, monkeypatch):
    """tempfile.gettempdir() of this process and of the processes it starts: a fresh folder."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", None)
    assert tempfile.gettempdir() == str(folder) and os.listdir(folder) == []
    return folder


def _failed(ip, line: str, cell: str) -> tuple[RankFailed, str]:
    with capture_output() as out:
        result = ip.run_cell(f"%%amp {line}\n{cell}")
    assert isinstance(result.error_in_exec, RankFailed), result.error_in_exec
    return result.error_in_exec, out.stdout + out.stderr


# rank 1 ends in one of these ways; rank 0 then waits for it in a collective
DEATHS = {
    "os._exit(3)": ("import os\nos._exit(3)", "exit code 3"),
    "SIGKILL": ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", "SIGKILL"),
    "os.abort()": ("import os\nos.abort()", "SIGABRT"),
    "sys.exit(3)": ("import sys\nsys.exit(3)", "SystemExit: 3"),
}


@pytest.mark.parametrize("how", sorted(DEATHS))
def test_the_rank_that_died_first_is_named_with_how_and_nothing_is_left(ip, temp_folder, how):
    code, says = DEATHS[how]
    body = "\n".join("    " + line for line in code.splitlines())
    cell = (f"import torch.distributed as dist\nprint('before', rank)\nif rank == 1:\n{body}\n"
            "dist.barrier()\n")
    error, shown = _failed(ip, "--nproc 2", cell)
    first = error.run.ranks[1]
    assert first.status == "failed" and says in first.error, first
    assert str(error).startswith("rank 1:") and says in str(error).split(";")[0]
    assert "--- rank 1 (failed) ---" in shown
    if error.run.ranks[0].status == "failed":  # the survivor's error, shown as a consequence
        assert shown.index("--- rank 1") < shown.index("--- rank 0 (failed, after rank 1 failed)")
        assert error.run.ranks[0].in_distributed and not first.in_distributed
    assert "[rank 1] before 1" in shown  # what it printed before it died comes back
    assert wait_gone(list(error.run.pids)) == []
    assert os.listdir(temp_folder) == []  # no torchelastic_* tree, no pytorch-errorfile-*


def test_a_rank_of_its_own_failure_is_named_before_one_whose_collective_lost_it():
    """A survivor may note its peer's death before the dead rank's watcher notes it."""
    died = RankResult(1, 11, "", None, "RankDied: ... exit code 3", "failed", failed_at=10.02)
    lost = RankResult(0, 10, "", None, "RuntimeError: Connection reset by peer", "failed",
                      failed_at=10.01, in_distributed=True)
    hung = RankResult(2, 12, "", None, "TimeoutError: ...", "timeout")
    run = DistributedRun(3, "cpu", None, (lost, died, hung), 1.0, ())
    assert [r.rank for r in _first_failure_first(run.ranks)] == [1, 0, 2]
    assert str(RankFailed(run)).startswith("rank 1: RankDied")


def test_sys_exit_0_or_none_is_a_clean_exit(ip, temp_folder):
    cell = "import sys\nprint('bye', rank)\nsys.exit(0 if rank == 0 else None)\n'not reached'"
    with capture_output() as out:
        ip.run_cell_magic("amp", "--nproc 2 -o run", cell)
    run = ip.user_ns["run"]
    assert run.ok and run.values == (None, None), run.ranks
    assert "[rank 0] bye 0" in out.stdout and "[rank 1] bye 1" in out.stdout
    assert os.listdir(temp_folder) == []


def test_timeout_stops_every_rank_and_says_which_ran_and_what_they_printed(ip, temp_folder):
    cell = ("import time\nprint('step 1 of rank', rank)\nif rank == 1:\n"
            "    print('waiting forever')\n    time.sleep(120)\nrank")
    t0 = time.monotonic()
    error, shown = _failed(ip, "--nproc 2 --timeout 5", cell)
    assert time.monotonic() - t0 < 60
    zero, one = error.run.ranks
    assert zero.status == "ok" and zero.value == 0
    assert one.status == "timeout" and "still running after 5 s" in one.error
    assert "waiting forever" in one.error  # what it printed last
    assert str(error).startswith("rank 1: TimeoutError")
    assert "--- rank 1 (timeout) ---" in shown and "--- rank 0" not in shown
    assert wait_gone(list(error.run.pids)) == []
    assert os.listdir(temp_folder) == []


@pytest.mark.parametrize("line", ["--nproc 2 --timeout 0", "--nproc 2 --timeout -1",
                                  "--nproc 2 --timeout soon", "--nproc 2 --timeout nan",
                                  "--nproc 2 --timeout inf"])
def test_bad_timeout_is_one_line_before_launching(ip, monkeypatch, line):
    from ampnb.magics import nproc

    monkeypatch.setattr(nproc, "launch", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(UsageError, match="^--timeout must be a number of seconds above 0") as e:
        ip.run_cell_magic("amp", line, "1")
    assert "\n" not in str(e.value)


def test_timeout_belongs_to_nproc_and_is_documented(ip):
    with pytest.raises(UsageError, match="--timeout .*--nproc"):
        ip.run_cell_magic("amp", "--timeout 5", "1")
    with pytest.raises(UsageError, match="--timeout"):
        ip.run_line_magic("amp", "--timeout 5")
    help_text = " ".join(AmpMagics.amp.__doc__.split())  # what %%amp? shows, unwrapped
    assert "--timeout SECONDS with --nproc: stop every rank after SECONDS (default 300)" in help_text
