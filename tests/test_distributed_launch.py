"""%%amp --nproc and the launcher: output by rank, names sent, failures shown, no process left."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from _magics_kit import amp, shell_with_ampnb
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

import ampnb
from ampnb.distributed import RankFailed, run_distributed
from ampnb.distributed._procs import alive, wait_gone

ip = pytest.fixture(shell_with_ampnb)

CELL = """\
import torch.distributed as dist
out = lin(x)
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
print("dtype", out.dtype, "sum", t.item(), "world", world_size, device)
print("ampnb", __import__("ampnb").__file__)
helper(rank) + Scale().k
"""


def test_a_cell_on_two_ranks_gets_the_notebooks_names_and_its_mode(ip):
    ip.run_cell("def helper(r):\n    return 10 * r\n\nclass Scale:\n    k = 3\n")
    _, out = amp(ip, "bf16-mixed --nproc 2 -o run", CELL)
    run = ip.user_ns["run"]
    lines = out.stdout.splitlines()
    assert "[rank 0] dtype torch.bfloat16 sum 3.0 world 2 cpu" in lines  # autocast, all_reduce
    assert "[rank 1] dtype torch.bfloat16 sum 3.0 world 2 cpu" in lines
    assert run.values == (0 + 3, 10 + 3) and run.ok and run.mode == "bf16-mixed"
    assert f"[rank 1] ampnb {ampnb.__file__}" in lines  # the ranks import this checkout's ampnb
    assert len(run.pids) == 5 and wait_gone(list(run.pids)) == []  # agent, 2 ranks, 2 watchers


def test_a_failing_rank_shows_its_traceback_and_every_process_ends(ip):
    cell = ("import torch.distributed as dist\nif rank == 1:\n    raise ValueError('bad rank')\n"
            "dist.barrier()\n")
    with capture_output() as out:
        result = ip.run_cell("%%amp --nproc 2\n" + cell)
    error = result.error_in_exec
    assert isinstance(error, RankFailed)
    assert "ValueError: bad rank" in error.run.ranks[1].error
    assert "raise ValueError('bad rank')" in error.run.ranks[1].error  # the cell's own line
    shown = out.stdout + out.stderr
    assert "--- rank 1 (failed) ---" in shown  # the cause comes first, without "after"
    assert str(error).startswith("rank 1: ValueError: bad rank")
    if error.run.ranks[0].status == "failed":  # rank 0 saw its peer go (or was stopped first)
        assert shown.index("--- rank 1") < shown.index("--- rank 0 (failed, after rank 1 failed)")
    assert error.run.ranks[1].status == "failed"
    assert wait_gone(list(error.run.pids)) == []


def test_an_interrupted_cell_leaves_no_process(ip, tmp_path):
    ip.user_ns["folder"] = str(tmp_path)
    cell = ("import os, time\nopen(f'{folder}/{rank}.pid', 'w').write(f'{os.getpid()} {os.getppid()}')\n"
            "time.sleep(120)\n")
    pids: list[int] = []

    def interrupt() -> None:
        end = time.monotonic() + 120
        while time.monotonic() < end:
            files = [tmp_path / f"{r}.pid" for r in range(2)]
            if all(f.exists() and f.read_text() for f in files):
                pids.extend(int(p) for f in files for p in f.read_text().split())
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=interrupt)
    thread.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            ip.run_cell_magic("amp", "--nproc 2", cell)
    finally:
        thread.join()
    assert len(set(pids)) == 4  # two ranks and the two processes watching them
    assert wait_gone(sorted(set(pids))) == []
    assert not any(alive(p) for p in pids)


@pytest.mark.parametrize("line, says", [
    ("--nproc 0", "--nproc must be a whole number from 1 to"),
    ("--nproc 100000", "--nproc must be a whole number from 1 to"),
    ("--nproc 2 --compare bf16-mixed", "cannot be combined with --nproc"),
    ("--nproc 2 --trace", "cannot be combined with --nproc"),
])
def test_bad_input_is_one_line_and_starts_nothing(ip, line, says):
    with pytest.raises(UsageError, match=says):
        ip.run_cell_magic("amp", line, "1")


def test_a_name_that_cannot_be_sent_is_a_usage_error(ip):
    ip.user_ns["lock"] = threading.Lock()
    with pytest.raises(UsageError, match="`lock` .* cannot be sent to the ranks"):
        ip.run_cell_magic("amp", "--nproc 2", "with lock:\n    pass\n")


def test_nccl_without_cuda_is_a_usage_error(ip):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(UsageError, match="cuda"):
        ip.run_cell_magic("amp", "--nproc 2 --device cuda", "1")


def test_nproc_is_a_cell_option(ip):
    with pytest.raises(UsageError, match="--nproc"):
        ip.run_line_magic("amp", "--nproc 2")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL needs CUDA")
def test_nccl_on_cuda():
    def reduce(rank, device):
        import torch.distributed as dist

        t = torch.ones(1, device=device) * (rank + 1)
        dist.all_reduce(t)
        return dist.get_backend(), t.item(), device.type

    n = torch.cuda.device_count()
    run = run_distributed(reduce, n, device="cuda", show_output=False)
    assert run.values == tuple(("nccl", n * (n + 1) / 2, "cuda") for _ in range(n))


def test_a_cell_past_its_timeout_is_stopped_with_every_process():
    run = run_distributed("import time\ntime.sleep(120)", 2, timeout=4, check=False,
                          show_output=False)
    assert not run.ok and {r.status for r in run.ranks} == {"timeout"}
    assert wait_gone(list(run.pids)) == []
