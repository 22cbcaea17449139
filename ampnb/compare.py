"""Run the same work under several precision modes: median time, memory, error against 32-true."""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ampnb.device import TF32_ALLOWED, sync, tf32_context, tf32_setting, tf32_state
from ampnb.display import Table
from ampnb.modes import get_mode

REFERENCE = "32-true"


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class Work:
    """What compare runs: `run()` returns the result; `reset()` (untimed) restores the start.

    `final`, when given, replaces `reset` before the very last run, so that a caller can let
    that run act on its own objects (they then end as after one ordinary run).
    """

    run: Callable[[], Any]
    reset: Callable[[], None] = _nothing
    final: Callable[[], None] | None = None


@dataclass(frozen=True)
class Row:
    """One mode's measurements; errors are against the 32-true run of the same work."""

    label: str
    mode: str
    tf32: str | None
    seconds: float
    times: tuple[float, ...]
    speedup: float
    saved_bytes: int
    peak_bytes: int | None
    max_abs_error: float
    rel_error: float
    result_dtypes: tuple[str, ...]


@dataclass(frozen=True)
class Comparison:
    """The result of `compare`: one Row per mode, the 32-true reference first."""

    device: str
    repeat: int
    warmup: int
    rows: tuple[Row, ...]

    @property
    def reference(self) -> Row:
        """The 32-true run with TF32 off (IEEE fp32) that speedups and errors are against."""
        return self.rows[0]

    def row(self, mode: str) -> Row:
        """The last row of a mode (any name or alias get_mode accepts)."""
        name = get_mode(mode).name
        found = [r for r in self.rows if r.mode == name]
        if not found:
            raise ValueError(f"mode {name!r} was not compared; compared: {', '.join(self.labels)}")
        return found[-1]

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(r.label for r in self.rows)

    def table(self) -> Table:
        """The comparison as an ampnb Table."""
        rows = [(r.label, format_seconds(r.seconds), f"{r.speedup:.2f}x", format_bytes(r.saved_bytes),
                 "-" if r.peak_bytes is None else format_bytes(r.peak_bytes),
                 _err(r.max_abs_error), _err(r.rel_error), ", ".join(r.result_dtypes) or "-")
                for r in self.rows]
        caption = (f"on {self.device}: median of {self.repeat} runs after {self.warmup} "
                   f"warm-up, device synchronised; errors against {REFERENCE} (TF32 off)")
        notes = ["activations saved: bytes autograd kept for backward (measured with "
                 "saved_tensors_hooks); peak: CUDA peak allocated beyond the start"]
        return Table(("mode", "median", "speedup", "activations saved", "peak", "max abs err",
                      "rel err", "result dtype"), rows, caption=caption, notes=notes)

    def _repr_html_(self) -> str:
        return self.table()._repr_html_()

    def __repr__(self) -> str:
        return repr(self.table())


def format_seconds(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def format_bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def _err(x: float) -> str:
    return "0" if x == 0 else f"{x:.2e}"


def leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in a result (tensors, numbers, modules' state, nested containers) by path."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj.detach()
    elif isinstance(obj, torch.nn.Module):
        yield from leaves(obj.state_dict(), prefix)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield prefix, torch.tensor(float(obj), dtype=torch.float64)
    elif isinstance(obj, Mapping):
        for k in sorted(obj, key=str):
            yield from leaves(obj[k], f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from leaves(v, f"{prefix}[{i}]")


def errors(result: Any, reference: Any) -> tuple[float, float]:
    """(max abs error, relative L2 error) of result's float tensors against reference's."""
    ref = {k: v for k, v in leaves(reference) if v.is_floating_point()}
    got = {k: v for k, v in leaves(result) if v.is_floating_point()}
    common = [k for k in ref if k in got and got[k].shape == ref[k].shape]
    if not common:
        return math.nan, math.nan
    worst, diff2, ref2 = 0.0, 0.0, 0.0
    for k in common:
        r = ref[k].to(torch.float64)
        d = got[k].to(device=r.device, dtype=torch.float64) - r
        if d.numel():
            m = d.abs().max().item()
            worst = math.nan if math.isnan(m) or math.isnan(worst) else max(worst, m)
        diff2 += d.square().sum().item()
        ref2 += r.square().sum().item()
    rel = math.sqrt(diff2) / math.sqrt(ref2) if ref2 else (0.0 if diff2 == 0 else math.inf)
    return worst, rel


def _dtypes(result: Any) -> tuple[str, ...]:
    found = {str(v.dtype).removeprefix("torch.") for _, v in leaves(result) if v.is_floating_point()}
    return tuple(sorted(found))


class _SavedBytes:
    """Sum of the storage bytes autograd saves for backward, each storage counted once."""

    def __init__(self) -> None:
        self.bytes = 0
        self._seen: set[int] = set()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            storage = t.untyped_storage()
            if storage.data_ptr() not in self._seen:
                self._seen.add(storage.data_ptr())
                self.bytes += storage.nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. sparse)
            pass
        return t

    def context(self) -> contextlib.AbstractContextManager:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def _device(device: str | torch.device) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"unknown device {device!r}; use 'cpu', 'cuda' or 'cuda:N'") from e


@dataclass(frozen=True)
class _Entry:
    mode: str
    tf32: str | None

    @property
    def label(self) -> str:
        return self.mode if self.tf32 in (None, "off") else f"{self.mode} + TF32 {self.tf32}"


def _entries(modes: Iterable[str] | str, setting: str | None) -> list[_Entry]:
    """The reference (32-true, TF32 off: IEEE fp32) first, then each mode under `setting`."""
    items = modes.split(",") if isinstance(modes, str) else list(modes)
    names = [get_mode(m).name for m in items if not (isinstance(m, str) and not m.strip())]
    if not names:
        raise ValueError("compare needs at least one mode, e.g. ('32-true', 'bf16-mixed')")
    if setting is None:  # "as is": what the flags say now, so that a duplicate is recognised
        setting = "on" if tf32_state().matmul else "off"
    entries = [_Entry(REFERENCE, "off"), *(_Entry(n, setting) for n in names)]
    return list(dict.fromkeys(entries))


def compare(work: Work | Callable[[], Any], modes: Iterable[str] | str = ("bf16-mixed",),
            device: str | torch.device = "cpu", repeat: int = 5, warmup: int = 1, seed: int = 0,
            tf32: str | bool | None = None,
            progress: Callable[[int, int, str], None] | None = None) -> Comparison:
    """Run `work` under 32-true and each mode; median time, memory and error against 32-true.

    The reference is 32-true with TF32 off (IEEE fp32); the modes run under `tf32` ('on',
    'off', 'emulate', None = as the flags are). Every run starts from `work.reset()` and
    `torch.manual_seed(seed)`; the RNG state is restored afterwards. Runs go round-robin over
    the modes so that drift hits all alike.
    """
    work = work if isinstance(work, Work) else Work(run=work)
    if not callable(work.run):
        raise ValueError(f"compare needs a callable or a Work, got {type(work.run).__name__}")
    for name, value, low in (("repeat", repeat, 1), ("warmup", warmup, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    try:
        setting = tf32_setting(tf32)
    except ValueError:
        raise ValueError(f"tf32 must be one of {TF32_ALLOWED}, got {tf32!r}") from None
    dev = _device(device)
    entries = _entries(modes, setting)
    for e in entries:
        get_mode(e.mode).check(dev)
    total = len(entries) * (warmup + repeat)
    times: dict[_Entry, list[float]] = {e: [] for e in entries}
    results: dict[_Entry, Any] = {}
    memory: dict[_Entry, tuple[int, int | None]] = {}
    done = 0

    def once(e: _Entry, meter: _SavedBytes | None = None) -> float:
        nonlocal done
        mode = get_mode(e.mode)
        last = done == total - 1 and work.final is not None
        (work.final if last else work.reset)()
        torch.manual_seed(seed)
        with contextlib.ExitStack() as stack:
            stack.enter_context(tf32_context(e.tf32, dev))
            stack.enter_context(mode.module_init_context())
            stack.enter_context(mode.forward_context(dev))
            if meter is not None:
                stack.enter_context(meter.context())
            sync(dev)
            t0 = time.perf_counter()
            results[e] = work.run()
            sync(dev)
            elapsed = time.perf_counter() - t0
        done += 1
        if progress is not None:
            progress(done, total, e.label)
        return elapsed

    with torch.random.fork_rng(devices=[dev.index or 0] if dev.type == "cuda" else []):
        for e in entries:
            meter, start = _SavedBytes(), _cuda_start(dev)
            once(e, meter)  # the first warm-up also measures memory
            memory[e] = (meter.bytes, _cuda_peak(dev, start))
            for _ in range(warmup - 1):
                once(e)
        for _ in range(repeat):
            for e in entries:
                times[e].append(once(e))
    ref = entries[0]
    rows = []
    for e in entries:
        med = statistics.median(times[e])
        err = (0.0, 0.0) if e == ref else errors(results[e], results[ref])
        rows.append(Row(e.label, e.mode, e.tf32, med, tuple(times[e]),
                        statistics.median(times[ref]) / med, *memory[e], *err,
                        _dtypes(results[e])))
    return Comparison(str(dev), repeat, warmup, tuple(rows))


def _cuda_start(dev: torch.device) -> int | None:
    if dev.type != "cuda":
        return None
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    return torch.cuda.memory_allocated(dev)


def _cuda_peak(dev: torch.device, start: int | None) -> int | None:
    if start is None:
        return None
    torch.cuda.synchronize(dev)
    return torch.cuda.max_memory_allocated(dev) - start
