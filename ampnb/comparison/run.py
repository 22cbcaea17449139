"""Run the same work under several precision modes: median time, memory, error against 32-true."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampnb._interrupt import Guard
from ampnb.batch import failure
from ampnb.comparison.result import REFERENCE, Comparison, Row, dtypes, errors, kept
from ampnb.device import TF32_ALLOWED, devices, place_model, sync, tf32_setting, tf32_state
from ampnb.device.placement import AUTO
from ampnb.fp16_kernels import fp16_kernels_choice, fp16_kernels_note
from ampnb.instruments.memory import MemoryMeter
from ampnb.modes import PrecisionMode, get_mode
from ampnb.precision import Precision
from ampnb.putback import rng_kept
from ampnb.putback import seed as seed_every_generator
from ampnb.selective import keep_patterns, matching_modules
from ampnb.step import StepSettings, all_of, cell_context


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


def _device(device: str | torch.device) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"unknown device {device!r}; use 'cpu', 'cuda' or 'cuda:N'") from e


@dataclass(frozen=True)
class _Entry:
    mode: PrecisionMode  # the mode as handed in: not looked up again by its name
    tf32: str | None

    @property
    def label(self) -> str:
        name = self.mode.name
        return name if self.tf32 in (None, "off") else f"{name} + TF32 {self.tf32}"


def _entries(modes: Iterable[str | PrecisionMode] | str, setting: str | None) -> list[_Entry]:
    """The reference (32-true, TF32 off: IEEE fp32) first, then each mode under `setting`."""
    items = modes.split(",") if isinstance(modes, str) else list(modes)
    found = [get_mode(m) for m in items if not (isinstance(m, str) and not m.strip())]
    if not found:
        raise ValueError("compare needs at least one mode, e.g. ('32-true', 'bf16-mixed')")
    if setting is None:  # "as is": what the flags say now, so that a duplicate is recognised
        setting = "on" if tf32_state().matmul else "off"
    entries = [_Entry(get_mode(REFERENCE), "off"), *(_Entry(m, setting) for m in found)]
    return list(dict.fromkeys(entries))


def compare(work: Work | Callable[[], Any],
            modes: Iterable[str | PrecisionMode] | str = ("bf16-mixed",),
            device: str | torch.device | None = None, repeat: int = 5, warmup: int | None = None,
            seed: int = 0,
            tf32: str | bool | None = None,
            progress: Callable[[int, int, str], None] | None = None, *,
            fp16_kernels: str | None = None,
            keep_fp32: str | Iterable[str] | None = None,
            model: nn.Module | Mapping[str, nn.Module] | None = None) -> Comparison:
    """Run `work` under 32-true and each mode; median time, memory and error against 32-true.

    The reference is 32-true with TF32 off (IEEE fp32); the modes run under `tf32` ('on',
    'off', 'emulate', None = as the flags are); each mode a name or a PrecisionMode, run as handed
    in. Every run starts from `work.prepare(mode)` and `putback.seed(seed)` (every generator) and
    ends with `work.restore()`; the RNG state is restored afterwards. Runs go round-robin over the modes so that drift hits all alike. A mode whose
    run raises gets a failed row with the error; only a failing 32-true run raises.
    The device is where `model`'s parameters are (torch's default device without a model);
    `device` only states it (ValueError naming both when they disagree). `warmup` runs per
    mode before timing: None is 1 on a CPU, 3 on an accelerator (lazy kernel set-up, autotune).
    `fp16_kernels` ('auto', 'native', 'emulated'; None = the process-wide setting) says how
    fp16 products run on a CPU; `keep_fp32` (module paths or globs in `model`, a module or a
    dict of them) runs those modules in fp32 in every mode but the reference.
    """
    options = CompareOptions(modes=modes, device=device, repeat=repeat, warmup=warmup, seed=seed,
                             tf32=tf32, progress=progress, fp16_kernels=fp16_kernels,
                             keep_fp32=keep_fp32, model=model)
    return compare_with(work, options)


@dataclass(frozen=True, eq=False, kw_only=True)
class CompareOptions:
    """How compare runs: the modes, device, timed repeats and warm-ups, seed, TF32, progress
    callback, fp16 kernels, modules kept in fp32 and the model they are named in."""

    modes: Iterable[str | PrecisionMode] | str = ("bf16-mixed",)
    device: str | torch.device | None = None
    repeat: int = 5
    warmup: int | None = None
    seed: int = 0
    tf32: str | bool | None = None
    progress: Callable[[int, int, str], None] | None = None
    fp16_kernels: str | None = None
    keep_fp32: str | Iterable[str] | None = None
    model: nn.Module | Mapping[str, nn.Module] | None = None


def _checked(o: CompareOptions) -> tuple[Any, dict, list[_Entry], Any]:
    """(fp16 kernels, islands, entries, placement); ValueError on a bad option."""
    modes, device, repeat, warmup, tf32 = o.modes, o.device, o.repeat, o.warmup, o.tf32
    fp16_kernels, keep_fp32, model = o.fp16_kernels, o.keep_fp32, o.model
    for name, value, low in (("repeat", repeat, 1), ("warmup", warmup, 1)):
        if name == "warmup" and value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    try:
        setting = tf32_setting(tf32)
    except ValueError:
        raise ValueError(f"tf32 must be one of {TF32_ALLOWED}, got {tf32!r}") from None
    stated = None if device in AUTO else _device(device)  # "auto": as place_model
    kernels = fp16_kernels_choice(fp16_kernels)
    if keep_fp32 is not None and model is None:
        raise ValueError("compare(keep_fp32=...) needs model=, the nn.Module (or a dict of them) "
                         "whose submodules the patterns name")
    islands = matching_modules(model, keep_fp32) if keep_fp32 is not None else {}
    entries = _entries(modes, setting)
    try:
        where = place_model(model, stated,
                            fallback="compare was given no model= to take it from")
    except ValueError:
        if stated is not None and all(d.type != stated.type for d in devices()):
            for e in entries:  # an absent device: the mode says what would run instead
                e.mode.check(stated)
        raise
    dev = torch.device(where.device)
    for e in entries:
        e.mode.check(dev)
    return kernels, islands, entries, where


def compare_with(work: Work | Callable[[], Any], o: CompareOptions) -> Comparison:
    """`compare` with its options in one record."""
    work = work if isinstance(work, Work) else Work(run=work)
    if not callable(work.run):
        raise ValueError(f"compare needs a callable or a Work, got {type(work.run).__name__}")
    kernels, islands, entries, where = _checked(o)
    dev = torch.device(where.device)
    warmup = (1 if dev.type == "cpu" else 3) if o.warmup is None else o.warmup
    repeat = o.repeat
    times, results, memory, notes, failed = _measure(work, o, entries, dev, kernels, islands,
                                                     warmup)
    for e in entries:
        said = [notes.get(e, "")]
        if e.mode.compute_dtype == torch.float16:
            said.append(fp16_kernels_note(dev, kernels))
        if islands and e != entries[0]:
            said.append(f"kept in fp32: {', '.join(islands)}")
        notes[e] = "; ".join(n for n in said if n)
    return Comparison(str(dev), repeat, warmup, tuple(_row(e, entries[0], times, results, memory,
                                                           notes, failed) for e in entries),
                      where.why)


def _measure(work: Work, o: CompareOptions, entries: list[_Entry], dev: torch.device, kernels: Any,
             islands: dict, warmup: int) -> tuple[dict, dict, dict, dict, dict]:
    """(times, results, memory, notes, failed) per entry, from runs round-robin over the modes."""
    total, done = len(entries) * (warmup + o.repeat), 0
    times: dict[_Entry, list[float]] = {e: [] for e in entries}
    results: dict[_Entry, Any] = {}  # the first run's kept result per mode
    memory: dict[_Entry, tuple[int, int | None]] = {}
    notes: dict[_Entry, str] = {}
    failed: dict[_Entry, str] = {}

    def once(e: _Entry, meter: MemoryMeter | None = None) -> float:
        nonlocal done
        p = Precision.of(e.mode, device=dev)
        # The reference stays IEEE fp32 throughout: no module kept in fp32 there.
        island = keep_patterns(o.keep_fp32) if islands and e != entries[0] else ()
        cell = cell_context(StepSettings(p, tf32_setting(e.tf32), kernels, island),
                            o.model if island else None)
        with Guard(lambda: work.prepare(p.mode), lambda _: work.restore()) as note:
            notes[e] = note
            seed_every_generator(o.seed, str(dev))
            with all_of([cell] + ([meter] if meter is not None else [])):
                sync(dev)
                t0 = time.perf_counter()
                value = work.run()
                sync(dev)
                elapsed = time.perf_counter() - t0
            if meter is not None:  # the first run of a mode: its result is the one compared
                results[e] = kept(work.keep(value))
        done += 1
        if o.progress is not None:
            o.progress(done, total, e.label)
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
            failed[e] = failure(error, 160)
            done += 1
            return None

    with rng_kept():
        for e in entries:
            meter = MemoryMeter(dev)
            attempt(e, meter)  # the first warm-up also measures memory
            memory[e] = (meter.peak_bytes, meter.cuda_peak_bytes)
            for _ in range(warmup - 1):
                attempt(e)
        for _ in range(o.repeat):
            for e in entries:
                seconds = attempt(e)
                if seconds is not None:
                    times[e].append(seconds)
    return times, results, memory, notes, failed


def _row(e: _Entry, ref: _Entry, times: dict, results: dict, memory: dict, notes: dict,
         failed: dict) -> Row:
    if e in failed:
        nan = math.nan
        return Row(e.label, e.mode.name, e.tf32, nan, tuple(times[e]), nan, 0, None, nan, nan, (),
                   f"failed: {failed[e]}", failed=True)
    med = statistics.median(times[e])
    err = (0.0, 0.0) if e == ref else errors(results[e], results[ref])
    return Row(e.label, e.mode.name, e.tf32, med, tuple(times[e]), statistics.median(times[ref]) / med,
               *memory[e], *err, dtypes(results[e]), notes.get(e, ""))
