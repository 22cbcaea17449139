"""`make gpu-check` exists and, without CUDA, says so and exits 0 (with CUDA it runs for real)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def test_makefile_has_the_gpu_check_target():
    assert "gpu-check:" in (ROOT / "Makefile").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, gpu-check runs the whole suite")
def test_gpu_check_without_cuda_says_so_and_exits_0():
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "no CUDA device" in done.stdout and torch.__version__ in done.stdout


def test_the_gpu_benchmark_reports_figures_only_where_there_is_cuda():
    from benchmarks import bench_gpu

    rows = bench_gpu.run()
    if not torch.cuda.is_available():
        assert len(rows) == 1 and rows[0].ok is None and "no CUDA" in rows[0].figure
    else:
        assert rows[0].ratio > 0 and all(r.figure for r in rows)


def _makefile_target(name: str) -> str:
    text = (ROOT / "Makefile").read_text()
    start = text.index(f"\n{name}:") + 1
    end = text.find("\n\n", start)
    return text[start:end]


def test_make_test_runs_the_kernel_sensitive_tests_as_an_avx2_cpu():
    target = _makefile_target("unit-avx2")
    assert "ATEN_CPU_CAPABILITY=avx2" in target and "unit-avx2" in _makefile_target("test")
    text = (ROOT / "Makefile").read_text()
    listed = text[text.index("AVX2_TESTS :="):text.index("\nunit-avx2:")].split()
    files = [f for f in listed if f.startswith("tests/")]
    assert "tests/test_distributed_parity.py" in files and "tests/test_fp16_kernels.py" in files
    assert all((ROOT / f).exists() for f in files)


def test_gpu_check_needs_no_venv_and_gpu_wheels_downloads_for_the_gpu_machine():
    assert "$(STAMP)" not in _makefile_target("gpu-check").splitlines()[0]  # no pip there
    assert "gpu_check wheels" in _makefile_target("gpu-wheels")
    from benchmarks import gpu_check

    pins = gpu_check.closure()
    for name in ("ipython", "ipywidgets", "nbval", "traitlets", "jedi", "comm"):
        assert name in pins
    assert "colorama" not in pins  # Windows only: markers are read for Linux
    cmd = gpu_check.download_command(pins, Path("/tmp/w"))
    assert cmd[cmd.index("--python-version") + 1] == "3.12" and "--no-deps" in cmd
    assert "--only-binary=:all:" in cmd and "manylinux2014_x86_64" in cmd
    assert "ipython==" + pins["ipython"] in cmd
    ignored = subprocess.run(["git", "check-ignore", "-q", str(gpu_check.WHEELS / "x.whl")],
                             cwd=ROOT)
    assert ignored.returncode == 0  # the wheels are never committed


def test_gpu_check_installs_only_what_the_machine_lacks(tmp_path):
    from benchmarks import gpu_check

    for name in ("ipython-9.0.0-py3-none-any.whl", "prompt_toolkit-3.0.0-py3-none-any.whl",
                 "not_installed_here-1.0-py3-none-any.whl"):
        (tmp_path / name).write_bytes(b"")
    assert [w.name for w in gpu_check.missing_wheels(tmp_path)] == [
        "not_installed_here-1.0-py3-none-any.whl"]


def test_gpu_check_runs_every_test_file_that_touches_cuda_in_parallel():
    from benchmarks import gpu_check

    files = gpu_check.cuda_tests()
    for name in ("test_magics.py", "test_magics_report.py", "test_trace.py", "test_memory.py",
                 "test_compare.py", "test_device_placement.py"):
        assert f"tests/{name}" in files
    assert "tests/test_formats.py" not in files
    cmd = gpu_check.pytest_command(files)
    assert cmd[-len(files):] == files
    assert gpu_check.TESTS_SECONDS + gpu_check.BENCH_SECONDS <= 300 - 10  # 5 minutes, install too


def test_the_gpu_benchmarks_compare_work_has_no_autocast_of_its_own():
    """compare() applies each mode; a step with its own autocast(enabled=False) inside would
    turn the mode's autocast off and time fp32 twice."""
    from ampnb.comparison import compare
    from ampnb.instruments import trace_ops
    from ampnb.models import demo
    from benchmarks import bench_gpu

    d = demo("mlp")
    model, opt, loss_fn, batches = d
    step = bench_gpu._plain_step(model, opt, loss_fn, *batches[0])
    c = compare(step, ("bf16-mixed",), repeat=1, model=model)
    assert c.device == "cpu" and not c.row("bf16-mixed").failed
    with torch.autocast("cpu", dtype=torch.bfloat16), trace_ops() as t:
        step()
    assert "bfloat16" in repr(t)


def test_the_report_keeps_every_failure_even_past_many_skips():
    from benchmarks import gpu_check

    out = "\n".join(["FAILED tests/test_a.py::test_x - boom", *(f"SKIPPED [1] s{i}" for i in range(200)),
                     "1 failed, 9 passed, 200 skipped in 3.0s"])
    shown = gpu_check.digest(out)
    assert shown.splitlines()[0] == "FAILED tests/test_a.py::test_x - boom"
    assert shown.splitlines()[-1].startswith("1 failed") and len(shown.splitlines()) < 40
    assert "-rfEs" in gpu_check.pytest_command([])  # failures are listed, not only skips


def test_a_stopped_parallel_run_still_names_its_failures():
    """xdist's -v lines ('[gw3] [ 30%] FAILED tests/...') are kept: a run stopped at its share of
    time prints no summary, and the failures must still be in the report."""
    from benchmarks import gpu_check

    out = "\n".join(["[gw1] [  7%] PASSED tests/test_a.py::test_ok",
                     "[gw3] [ 30%] FAILED tests/test_a.py::test_x",
                     *(f"[gw0] [ 40%] PASSED tests/test_b.py::t{i}" for i in range(100))])
    shown = gpu_check.digest(out).splitlines()
    assert shown[0] == "[gw3] [ 30%] FAILED tests/test_a.py::test_x"
    assert not any("test_ok" in line for line in shown[:1])


def test_the_parallel_run_is_verbose_not_cancelled_by_quiet(monkeypatch):
    """With xdist, -v must not sit beside -q: pytest adds the two up and prints dots."""
    import importlib.util

    from benchmarks import gpu_check

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "xdist" else real(name, *a))
    cmd = gpu_check.pytest_command(["tests/test_x.py"])
    assert cmd.count("-v") - cmd.count("-q") == 1
