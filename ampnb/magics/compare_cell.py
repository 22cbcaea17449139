"""`%%amp --compare`: the cell under 32-true and each mode, every run from the same saved start."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
from IPython.core.error import UsageError
from IPython.display import Pretty, display

from ampnb._interrupt import Guard
from ampnb._tree import tensors
from ampnb.comparison import Work, compare
from ampnb.comparison.snapshot import KEEP_NEEDS_A_MODEL, StartState, used_names
from ampnb.device import Placement
from ampnb.display import dtype_name
from ampnb.magics.cell import Watch, compile_cell, run_cell
from ampnb.magics.report import AmpRun
from ampnb.magics.runs import _available, _notes, _tf32_text, measure_apart
from ampnb.modes import MODES, PrecisionMode, get_mode
from ampnb.step import StepSettings


class _Progress:
    """An updating line, shown only once a compare has run for more than a second."""

    def __init__(self, quiet: bool) -> None:
        self.quiet, self.t0, self.handle, self.total = quiet, time.perf_counter(), None, 0

    def __call__(self, done: int, total: int, mode: str) -> None:
        self.total = total
        if self.quiet or (self.handle is None and time.perf_counter() - self.t0 < 1.0):
            return
        line = Pretty(f"%%amp --compare: {done}/{total} runs done (last: {mode})")
        if self.handle is None:
            self.handle = display(line, display_id=True)
        else:
            self.handle.update(line)

    def close(self) -> None:
        if self.handle is not None:
            self.handle.update(Pretty(f"%%amp --compare: all {self.total} runs done"))


def compare_modes(text: str, device: str) -> list[PrecisionMode]:
    """The modes of --compare M1,M2, each checked on the device (UsageError otherwise)."""
    try:
        modes = [_available(get_mode(m.strip()), device) for m in text.split(",") if m.strip()]
    except ValueError as e:
        raise UsageError(str(e)) from None
    if not modes:
        raise UsageError(f"--compare needs modes, e.g. --compare 32-true,bf16-mixed; "
                         f"choose from {', '.join(MODES)}")
    return modes


class _Runs:
    """Each run: the saved start restored, converted for its mode, watched; restored after."""

    def __init__(self, start: StartState, ns: dict[str, Any], names: frozenset[str]) -> None:
        self.start, self.ns, self.names = start, ns, names
        self.watch: Watch | None = None
        self.converted: dict[str, list[str]] = {}

    def prepare(self, mode: PrecisionMode) -> str:
        try:
            self.start.restore()
            done = self.start.convert(mode)
            self.watch = Watch(self.ns, self.names)
        except BaseException:
            self.start.restore()  # half converted: back to the start before raising
            raise
        self.converted[mode.name] = done
        if not mode.is_mixed and mode.param_dtype != torch.float32 and not self.start.used_modules():
            return (f"not converted: no module made before the cell is named by it or by the "
                    f"functions it calls; only what the cell creates is {dtype_name(mode.param_dtype)}")
        return ""

    def keep(self, value: Any) -> Any:
        """The cell's value; else what it rebound; else the modules it changed (a train step)."""
        if value is not None:
            return value
        changed = {k: v for k, v in self.watch.changed().items()
                   if isinstance(v, torch.nn.Module) or tensors(v)}
        return changed or self.start.changed_modules()


def run_compare(shell: Any, cell: str, s: StepSettings, modes_text: str, repeat: int,
                quiet: bool = False, where: Placement | None = None) -> AmpRun:
    """Run the cell under 32-true and each mode from the same start; compare table."""
    __tracebackhide__ = True  # noqa: F841
    modes = compare_modes(modes_text, s.device)
    compiled = compile_cell(shell, cell)
    measure_apart(modes, s.device)
    ns = shell.user_ns
    with Guard(lambda: StartState(ns, used_names(compiled.names, ns)), lambda st: st.restore()) as start:
        runs = _Runs(start, ns, compiled.names)
        work = Work(lambda: run_cell(compiled, ns), prepare=runs.prepare, restore=start.restore,
                    keep=runs.keep)
        progress = _Progress(quiet)
        models = start.used_modules() if s.keep_fp32 else None
        if s.keep_fp32 and not models:
            raise UsageError(KEEP_NEEDS_A_MODEL)
        try:
            result = compare(work, modes, s.device, repeat=repeat, tf32=s.tf32,
                             progress=progress, fp16_kernels=s.fp16_kernels,
                             keep_fp32=s.keep_fp32 or None, model=models)
        except ValueError as e:
            if s.keep_fp32 and "keep_fp32" in str(e):
                raise UsageError(str(e)) from None
            raise
        finally:
            progress.close()
    notes = [n for m in modes for n in _notes(s, m)]
    notes.append(f"every run started from the state before the cell (torch seed 0), restored "
                 f"after each run and at the end: {start.summary()}; afterwards these and the "
                 f"names the cell binds are as before the cell (run it without --compare to "
                 f"keep its effects)")
    for mode, done in runs.converted.items():
        if done:
            notes.append(f"{mode}: {', '.join(done)} converted with get_mode({mode!r}) "
                         f"(convert_module / convert_input) for its runs, then restored exactly")
    if start.unrestored():
        notes.append(f"changed in place and too large to copy, so NOT restored: "
                     f"{', '.join(start.unrestored())}")
    why = where.why if where is not None else ""
    return AmpRun("compare", s.device, _tf32_text(s), None, (), tuple(dict.fromkeys(notes)),
                  comparison=dataclasses.replace(result, why=why) if why else result, why=why)
