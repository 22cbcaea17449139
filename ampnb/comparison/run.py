"""Run the same work under several precision modes: median time, memory, error against 32-true."""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ampnb._interrupt import Guard
from ampnb._tf32 import TF32_SETTINGS, tf32_context
from ampnb._tree import named_leaves
from ampnb.device import sync, tf32_state
from ampnb.display import Table, TableView, format_bytes, format_seconds
from ampnb.instruments.memory import MemoryMeter
from ampnb.modes import PrecisionMode, get_mode

REFERENCE = "32-true"


def _no_note(mode: PrecisionMode) -> str:
    return ""


def _nothing() -> None:
    return None


def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Work:
    """What compare runs: `run()` (timed) returns the result; the rest is untimed.

    `prepare(mode)` sets up the start of a run for a mode and returns a note for its row
    ('' for none); `restore()` undoes it after every run (also on error or interrupt);
    `keep(value)` turns a run's value into what is compared, before `restore()` runs.
    """

    run: Callable[[], Any]
    prepare: Callable[[PrecisionMode], str] = _no_note
    restore: Callable[[], None] = _nothing
    keep: Callable[[Any], Any] = _same


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
    note: str = ""  # why the row is not what it seems: a failure, or nothing converted
    failed: bool = False


@dataclass(frozen=True, repr=False)
class Comparison(TableView):
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
        noted = any(r.note for r in self.rows)
        rows = []
        for r in self.rows:
            if r.failed:
                cells = [r.label, "failed", *["-"] * 6]
            else:
                cells = [r.label, format_seconds(r.seconds), f"{r.speedup:.2f}x",
                         format_bytes(r.saved_bytes), format_bytes(r.peak_bytes),
                         _err(r.max_abs_error), _err(r.rel_error), ", ".join(r.result_dtypes) or "-"]
            rows.append((*cells, r.note) if noted else tuple(cells))
        caption = (f"on {self.device}: median of {self.repeat} runs after {self.warmup} "
                   f"warm-up, device synchronised; errors against {REFERENCE} (TF32 off)")
        notes = ["activations saved: peak bytes autograd held for backward (memory_meter; "
                 "parameters excluded); peak: CUDA peak allocated beyond the start"]
        return Table(("mode", "median", "speedup", "activations saved", "peak", "max abs err",
                      "rel err", "result dtype", *(("note",) if noted else ())), rows,
                     caption=caption, notes=notes)


def _err(x: float) -> str:
    return "0" if x == 0 else f"{x:.2e}"


def leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in a result (tensors, numbers, modules' state, any container) by path."""
    for path, leaf in named_leaves(obj, prefix):
        if isinstance(leaf, torch.Tensor):
            yield path, leaf.detach()
        elif isinstance(leaf, torch.nn.Module):
            yield from leaves(dict(leaf.state_dict()), path)
        elif isinstance(leaf, (int, float)) and not isinstance(leaf, bool):
            yield path, torch.tensor(float(leaf), dtype=torch.float64)


def kept(value: Any) -> dict[str, torch.Tensor]:
    """A result's tensors by path, copied: what later runs or restores cannot change."""
    return {k: v.clone() for k, v in leaves(value)}


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


class _Entered(list):
    """What each context's __enter__ returned, and the stack that leaves them."""

    stack: contextlib.ExitStack


def _enter_all(contexts: list[contextlib.AbstractContextManager]) -> _Entered:
    """Enter every context in order; on an error, leave those entered before raising."""
    entered = _Entered()
    entered.stack = contextlib.ExitStack()
    try:
        for c in contexts:
            entered.append(entered.stack.enter_context(c))
    except BaseException:
        entered.stack.close()
        raise
    return entered


def guarded(contexts: list[contextlib.AbstractContextManager]) -> Guard:
    """One context for several: all of them are entered, or none; leaving always completes.

    `as` gives the list of what each context's __enter__ returned.
    """
    return Guard(lambda: _enter_all(contexts), lambda entered: entered.stack.close())


def _one_line(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    text = f"{type(e).__name__}: {first}" if first else type(e).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def compare(work: Work | Callable[[], Any], modes: Iterable[str] | str = ("bf16-mixed",),
            device: str | torch.device = "cpu", repeat: int = 5, warmup: int = 1, seed: int = 0,
            tf32: str | bool | None = None,
            progress: Callable[[int, int, str], None] | None = None) -> Comparison:
    """Run `work` under 32-true and each mode; median time, memory and error against 32-true.

    The reference is 32-true with TF32 off (IEEE fp32); the modes run under `tf32` ('on',
    'off', 'emulate', None = as the flags are). Every run starts from `work.prepare(mode)` and
    `torch.manual_seed(seed)` and ends with `work.restore()`; the RNG state is restored
    afterwards. Runs go round-robin over the modes so that drift hits all alike. A mode whose
    run raises gets a failed row with the error; only a failing 32-true run raises.
    """
    work = work if isinstance(work, Work) else Work(run=work)
    if not callable(work.run):
        raise ValueError(f"compare needs a callable or a Work, got {type(work.run).__name__}")
    for name, value, low in (("repeat", repeat, 1), ("warmup", warmup, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if tf32 not in TF32_SETTINGS:
        raise ValueError(f"tf32 must be one of {', '.join(map(repr, TF32_SETTINGS))}, got {tf32!r}")
    dev = _device(device)
    entries = _entries(modes, TF32_SETTINGS[tf32])
    for e in entries:
        get_mode(e.mode).check(dev)
    total = len(entries) * (warmup + repeat)
    times: dict[_Entry, list[float]] = {e: [] for e in entries}
    results: dict[_Entry, Any] = {}
    memory: dict[_Entry, tuple[int, int | None]] = {}
    notes: dict[_Entry, str] = {}
    failed: dict[_Entry, str] = {}
    done = 0

    def once(e: _Entry, meter: MemoryMeter | None = None) -> float:
        nonlocal done
        mode = get_mode(e.mode)
        contexts = [tf32_context(e.tf32, dev), mode.module_init_context(), mode.forward_context(dev)]
        with Guard(lambda: work.prepare(mode), lambda _: work.restore()) as note:
            notes[e] = note
            torch.manual_seed(seed)
            with guarded(contexts + ([meter] if meter is not None else [])):
                sync(dev)
                t0 = time.perf_counter()
                value = work.run()
                sync(dev)
                elapsed = time.perf_counter() - t0
            if meter is not None:  # the first run of a mode: its result is the one compared
                results[e] = kept(work.keep(value))
        done += 1
        if progress is not None:
            progress(done, total, e.label)
        return elapsed

    def attempt(e: _Entry, meter: MemoryMeter | None = None) -> float | None:
        nonlocal done
        if e in failed:
            done += 1
            return None
        try:
            return once(e, meter)
        except Exception as error:  # noqa: BLE001 - one mode failing leaves the others' rows
            if e == entries[0]:
                raise
            failed[e] = _one_line(error)
            done += 1
            return None

    with torch.random.fork_rng(devices=[dev.index or 0] if dev.type == "cuda" else []):
        for e in entries:
            meter = MemoryMeter(dev)
            attempt(e, meter)  # the first warm-up also measures memory
            memory[e] = (meter.peak_bytes, meter.cuda_peak_bytes)
            for _ in range(warmup - 1):
                attempt(e)
        for _ in range(repeat):
            for e in entries:
                seconds = attempt(e)
                if seconds is not None:
                    times[e].append(seconds)
    return Comparison(str(dev), repeat, warmup, tuple(_row(e, entries[0], times, results, memory,
                                                           notes, failed) for e in entries))


def _row(e: _Entry, ref: _Entry, times: dict, results: dict, memory: dict, notes: dict,
         failed: dict) -> Row:
    if e in failed:
        nan = math.nan
        return Row(e.label, e.mode, e.tf32, nan, tuple(times[e]), nan, 0, None, nan, nan, (),
                   f"failed: {failed[e]}", failed=True)
    med = statistics.median(times[e])
    err = (0.0, 0.0) if e == ref else errors(results[e], results[ref])
    return Row(e.label, e.mode, e.tf32, med, tuple(times[e]), statistics.median(times[ref]) / med,
               *memory[e], *err, _dtypes(results[e]), notes.get(e, ""))
