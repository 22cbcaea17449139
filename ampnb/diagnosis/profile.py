"""Why a mode is (not) faster here: one step under torch.profiler, op time by dtype and casts."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch._C._autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from ampnb._quiet import QuietProfile
from ampnb.diagnosis.candidates import Candidate
from ampnb.diagnosis.run import Setup, _copy, _step
from ampnb.display import Table, TableView, format_percent, format_seconds

CASTS = frozenset({"aten::to", "aten::_to_copy", "aten::copy_"})
MATMULS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::convolution",
                     "aten::_convolution", "aten::mkldnn_convolution"})
DTYPES = {"float": "fp32", "c10::BFloat16": "bf16", "c10::Half": "fp16", "double": "fp64",
          "c10::Float8_e4m3fn": "fp8_e4m3", "c10::Float8_e5m2": "fp8_e5m2"}
ALIGN = 8  # fp16/bf16 tensor cores want matrix dimensions that are multiples of 8 (FP8: 16)


@dataclass(frozen=True, repr=False)
class Profile(TableView):
    """Self time of one step by op kind and dtype, the share spent casting, unaligned matmuls."""

    name: str
    how: str
    total_s: float
    cast_s: float
    by_dtype: dict[str, float]      # dtype of the op's first floating input -> self seconds
    top_ops: tuple[tuple[str, str, float, int], ...]   # (op, dtype, self seconds, calls)
    unaligned: tuple[tuple[str, tuple[int, ...]], ...]  # matmul shapes with a dim % 8 != 0

    @property
    def cast_share(self) -> float:
        return self.cast_s / self.total_s if self.total_s else 0.0

    @property
    def why(self) -> str:
        """One line: casts, time by dtype, unaligned matmuls, and how the machine runs the mode."""
        dt = ", ".join(f"{k} {format_percent(v / self.total_s)}"
                       for k, v in sorted(self.by_dtype.items(), key=lambda kv: -kv[1])
                       if self.total_s and v / self.total_s >= 0.01)
        parts = [f"casts {format_percent(self.cast_share)} of op time", f"op time by dtype: {dt}"]
        if self.unaligned:
            parts.append(f"{len(self.unaligned)} matmul shapes with a dimension not a multiple "
                         f"of {ALIGN}")
        if self.how != "native":
            parts.append(self.how)
        return "; ".join(parts)

    def table(self) -> Table:
        rows = [(op, dt, format_seconds(s), format_percent(s / self.total_s if self.total_s else 0),
                 n) for op, dt, s, n in self.top_ops]
        notes = [f"why: {self.why}"]
        notes += [f"unaligned {op}: {'x'.join(map(str, shape))}" for op, shape in self.unaligned[:5]]
        return Table(("op", "dtype", "self time", "share", "calls"), rows,
                     caption=f"profile of one step in {self.name} ({self.how}): "
                             f"{format_seconds(self.total_s)} of op time", notes=notes)


@dataclass(frozen=True)
class Op:
    """One aten op the profiler saw: its input dtypes and shapes, and its self CPU seconds."""

    name: str
    input_dtypes: tuple[str, ...]
    input_shapes: tuple[Any, ...]
    self_s: float


def _close(stack: list[list[Any]], ops: list[Op]) -> None:
    """The event on top of the stack is done: its aten op goes to ops with its self time."""
    _, children_ns, children, last, ev = stack.pop()
    name, self_s = ev.name(), (ev.duration_ns() - children_ns) * 1e-9
    if not name.startswith("aten::"):
        return
    if children == 1 and last == name:  # torch's _remove_dup_nodes: one op, not two
        self_s += ops.pop().self_s
    ops.append(Op(name, tuple(ev.dtypes()), tuple(ev.shapes()), self_s))


def aten_ops(prof: Any) -> list[Op]:
    """The aten ops of a finished torch.profiler run with their self times, as torch's
    FunctionEvent tree gives them (per thread, an op's span less its direct children's; an op
    nested once in itself, as autocast re-dispatches it, counted once), read from kineto's raw
    events: building torch's tree costs several training steps on a transformer."""
    ops: list[Op] = []
    by_thread: dict[int, list[Any]] = defaultdict(list)
    for e in prof.profiler.kineto_results.events():
        if e.device_type() == DeviceType.CPU and not e.is_async():
            by_thread[e.start_thread_id()].append(e)
    for events in by_thread.values():
        events.sort(key=lambda e: (e.start_ns(), -e.duration_ns()))
        stack: list[list[Any]] = []  # [end ns, children's ns, children, last child's name, event]
        for e in events:
            end = e.start_ns() + e.duration_ns()
            while stack and stack[-1][0] < end:  # not inside the one on top: that one is done
                _close(stack, ops)
            if stack:
                stack[-1][1] += e.duration_ns()
                stack[-1][2] += 1
                stack[-1][3] = e.name()
            stack.append([end, 0, 0, "", e])
        while stack:
            _close(stack, ops)
    return ops


def _dtype(event: Any) -> str:
    for d in getattr(event, "input_dtypes", None) or ():
        if d in DTYPES:
            return DTYPES[d]
    return "other"


def _unaligned(event: Any) -> tuple[int, ...] | None:
    shapes = [tuple(s) for s in (event.input_shapes or ()) if isinstance(s, list) and len(s) >= 2]
    dims = {d for s in shapes[:3] for d in s[-2:]}
    return shapes[0] + shapes[1][-1:] if len(shapes) >= 2 and any(d % ALIGN for d in dims) else None


def profile_run(setup: Setup, cand: Candidate, scale: float | None = None, top: int = 12,
                warmup: bool = True) -> Profile:
    """Profile one step (forward, backward, optimizer step) of a candidate, after a warm-up."""
    net, opt = _copy(setup, cand)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                     if torch.device(setup.device).type == "cuda" else [])
    p = cand.bound(scale)
    with cand.context():
        if warmup:
            _step(net, opt, setup, p)
        with QuietProfile(profile(activities=acts, record_shapes=True)) as prof:
            _step(net, opt, setup, p)
    events = aten_ops(prof)
    self_s = {id(e): e.self_s for e in events}
    by_dtype: dict[str, float] = defaultdict(float)
    per_op: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    unaligned: dict[tuple[str, tuple[int, ...]], None] = {}
    for e in events:
        dt, s = _dtype(e), self_s[id(e)]
        by_dtype[dt] += s
        per_op[(e.name.removeprefix("aten::"), dt)][0] += s
        per_op[(e.name.removeprefix("aten::"), dt)][1] += 1
        if e.name in MATMULS and (shape := _unaligned(e)) is not None:
            unaligned[(e.name.removeprefix("aten::"), shape)] = None
    total = sum(self_s.values())
    cast = sum(self_s[id(e)] for e in events if e.name in CASTS)
    ops = sorted(((op, dt, s, int(n)) for (op, dt), (s, n) in per_op.items()), key=lambda r: -r[2])
    return Profile(cand.name, cand.how, total, cast, dict(by_dtype), tuple(ops[:top]),
                   tuple(unaligned))
