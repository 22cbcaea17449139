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
