"""Measured matmul throughput per device and dtype."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from ampnb.device.hardware import devices, get_device, support, sync
from ampnb.device.tf32_switch import tf32
from ampnb.display import Table
from ampnb.formats import get_format
from ampnb.putback import generator

_MEASURABLE = ("fp64", "fp32", "tf32", "bf16", "fp16")
_TABLE_FORMATS = ("fp32", "tf32", "bf16", "fp16")
_MIN_TIMED = 2e-3  # seconds per timed sample: short matmuls are batched up to this
_WARMUP, _REPEAT = 3, 7
_SLOW_SHRINK = 4   # n / 4 = 64x fewer flops where the CPU has no units for the dtype


@dataclass(frozen=True)
class Throughput:
    """One measured n x n matmul: seconds per matmul (median) and TFLOP/s (2 n^3 flops)."""

    device: str
    dtype: str
    n: int
    seconds: float
    tflops: float
    note: str = ""


_CACHE: dict[tuple[str, str, int, bool], Throughput] = {}


def _measure(device: torch.device, fmt: str, n: int, note: str) -> Throughput:
    dtype = torch.float32 if fmt == "tf32" else get_format(fmt).torch_dtype
    gen = generator(0, device)  # leaves the user's RNG stream alone
    a, b = (torch.randn(n, n, generator=gen, device=device).to(dtype) for _ in range(2))
    with tf32(fmt == "tf32"), torch.no_grad():
        once = []
        for _ in range(_WARMUP):  # kernel selection, lazy init, waking the thread pool
            t0 = time.perf_counter()
            torch.mm(a, b)
            sync(device)
            once.append(time.perf_counter() - t0)
        inner = max(1, min(1000, int(_MIN_TIMED / max(min(once), 1e-9))))
        samples = []
        for _ in range(_REPEAT):
            t0 = time.perf_counter()
            for _ in range(inner):
                torch.mm(a, b)
            sync(device)
            samples.append((time.perf_counter() - t0) / inner)
    seconds = statistics.median(samples)
    return Throughput(str(device), fmt, n, seconds, 2 * n**3 / seconds / 1e12, note)


def matmul_throughput(device: object = "cpu", dtype: object = "fp32", n: int = 512,
                      refresh: bool = False) -> Throughput:
    """Measured TFLOP/s of an n x n matmul (median, device-synced); cached per arguments.

    On a CPU without native units for the dtype (fp16, bf16) it measures n/4 instead, so the
    call stays quick; the record's `n` and `note` say so.
    """
    dev = get_device(device)
    fmt = get_format(dtype).name
    if fmt not in _MEASURABLE:
        raise ValueError(f"matmul_throughput measures {', '.join(_MEASURABLE)}; got {dtype!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 16:
        raise ValueError(f"matmul size n must be an int >= 16, got {n!r}")
    found = support(fmt, dev)
    if not found.ok:
        raise ValueError(f"{fmt} matmul does not run on {dev.name}: {found.reason}")
    key = (dev.name, fmt, n, found.native)  # native decides the size (CPU features may be injected)
    if refresh or key not in _CACHE:
        size, note = n, ""
        if dev.type == "cpu" and not found.native:
            size = max(16, n // _SLOW_SHRINK)
            note = f"n={size} instead of {n} ({found.reason})"
        _CACHE[key] = _measure(torch.device(dev.name), fmt, size, note)
    return _CACHE[key]


def throughput_table(device: object = None, refresh: bool = False) -> Table:
    """Measured matmul TFLOP/s for fp32, tf32 (CUDA), bf16 and fp16 on each device."""
    rows = []
    for dev in [get_device(device)] if device is not None else devices():
        for fmt in _TABLE_FORMATS:
            if fmt == "tf32" and dev.type != "cuda":
                continue
            found = support(fmt, dev)
            if not found.ok:
                rows.append((dev.name, fmt, "-", "-", "-", "-", found.reason))
                continue
            t = matmul_throughput(dev, fmt, refresh=refresh)
            base = matmul_throughput(dev, "fp32", t.n)  # the same size, so the ratio is fair
            ratio = f"{t.tflops / base.tflops:.2f}x"
            rows.append((dev.name, fmt, t.n, f"{t.seconds * 1e3:.3g} ms", f"{t.tflops:.3g}",
                         ratio, t.note))
    return Table(("device", "dtype", "n", "time / matmul", "TFLOP/s", "vs fp32", "note"), rows,
                 caption="Matmul throughput, measured on this machine",
                 notes=(f"Median of {_REPEAT} device-synced samples of n x n matmuls "
                        "(2 n^3 flops each), after a warm-up; 'vs fp32' compares with fp32 at the same n.",))
