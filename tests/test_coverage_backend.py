"""coverage_backend(): the compiled CPU kernel counts exactly what the eager one counts."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from ampnb.formats import get_format
from ampnb.instruments import _bitkeys, coverage_backend, kernels
from ampnb.instruments import coverage_stats as cs

FORMATS = ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "tf32")


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 4096 elements, so compiling and checking stay quick; backend reset after."""
    monkeypatch.setattr(_bitkeys, "_CHUNK", 4096)
    monkeypatch.setitem(kernels._STATE, "fn", None)
    monkeypatch.setitem(kernels._STATE, "name", "eager")
    yield
    _bitkeys._SCRATCH.clear()


def _data(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, generator=g) * torch.exp2(torch.empty(n).uniform_(-150, 128, generator=g))
    x[::97] = 0.0
    x[5::1001] = math.inf
    x[6::1003] = math.nan
    x[7::89] = 65520.0  # exactly on fp16's overflow point
    return x


def test_default_is_eager_and_bad_names_name_the_allowed_ones(small_chunks):
    assert coverage_backend() == "eager"
    with pytest.raises(ValueError, match="eager, compiled") as e:
        coverage_backend("fast")
    assert "\n" not in str(e.value) and coverage_backend() == "eager"


def test_compiled_kernel_counts_what_eager_counts(small_chunks):
    x = _data(3 * 4096 + 123)  # three whole chunks (compiled) and a short one (eager)
    fmts = tuple(get_format(f) for f in FORMATS)
    eager = cs.segment_stats(x, [x.numel()], fmts)
    assert coverage_backend("compiled") == "compiled"
    calls = []
    fn = kernels._STATE["fn"]
    kernels._STATE["fn"] = lambda x, **kw: calls.append(x.numel()) or fn(x, **kw)
    compiled = cs.segment_stats(x, [x.numel()], fmts)
    assert calls == [4096] * 3
    assert compiled == eager == cs._bucketize_stats(x, [x.numel()], fmts)
    coverage_backend("eager")
    assert cs.segment_stats(x, [x.numel()], fmts) == eager and len(calls) == 3


def test_a_failing_compile_is_one_line_and_keeps_eager(small_chunks, monkeypatch):
    def broken(fn, **kwargs):
        def run(*args):
            raise OSError("no C++ compiler found\ndetails that do not belong in the message")
        return run
    monkeypatch.setattr(torch, "compile", broken)
    with pytest.raises(RuntimeError, match="not available here .*OSError: no C.. compiler") as e:
        coverage_backend("compiled")
    assert "\n" not in str(e.value) and "eager" in str(e.value)
    assert coverage_backend() == "eager" and kernels._STATE["fn"] is None


def test_imports_point_one_way_kernels_to_bitkeys():
    code = ("import sys, ampnb.instruments._bitkeys, ampnb.instruments.coverage_stats; "
            "print('ampnb.instruments.kernels' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"  # counting never needs the backend chooser
