"""Autocast op tracer: which aten op ran in which dtype, from which module, forward or backward.

Stable API (PrecisionPanel and `%%amp --trace` use it):

    with ampnb.trace_ops(limit=100_000) as t:   # any torch code: autocast, true modes, backward
        loss_fn(model(x), y).backward()
    t.rows (list[OpRow], first `limit` ops in order); t.counts ({category: n}, all ops);
    t.select(op="addmm", module="body.*", category=None, phase=None) (globs) -> list[OpRow];
    t.table(limit=60) (Table, one line per distinct row + count); t.summary() (one line).
    trace_ops(detail="summary"): counts only (t.grouped, t.counts, t.summary(), t.table());
    no module paths (module is ""), no t.rows; several times cheaper than "full".

OpRow (frozen): op (aten name, "addmm"), module (path from the outermost module that ran, which
shows as its class name: "MLP", "body.0"; "" outside any), phase ("forward"/"backward"),
input_dtypes, output_dtype ("" if no tensor out), cast_from (dtypes the inputs had before a
`_to_copy` inside the trace: autocast's casts; it caches weight casts per autocast region, so
enter the trace outside it), category, .cast. Categories: lowered (float output < 32 bits),
kept (fp32/fp64), promoted (wider than a float input), cast (dtype-changing `_to_copy`),
other (views, non-float outputs). A TorchDispatchMode sees ops after autocast cast them (CPU
and CUDA alike); backward ops get the module whose forward made their autograd node (a key in
that node's `metadata`, left there).
"""

from __future__ import annotations

import fnmatch
import functools
import threading
from collections import Counter
from contextlib import ContextDecorator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _module
from torch.utils._python_dispatch import TorchDispatchMode

from ampnb._interrupt import Guard
from ampnb._tree import tensors
from ampnb._weak import WeakIdMap
from ampnb.display import Table, TableView, dtype_name

CATEGORIES = ("lowered", "kept", "promoted", "cast", "other")
_NODE_KEY = "ampnb_module"  # key in autograd Node.metadata: the module that made the node
_TO_COPY = torch.ops.aten._to_copy.default
_local = threading.local()


def _deeper() -> int:
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    return depth


def _restore_depth(depth: int) -> None:
    _local.depth = depth


class internal(Guard):  # noqa: N801 - used like a function: `with internal():`
    """`with internal():` keeps ampnb's own measuring ops (capture's summaries, the hunter's
    checks) out of traces and hunts; an interrupt anywhere leaves the depth as it was."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(_deeper, _restore_depth)


def is_internal() -> bool:
    """True while ampnb's own measuring ops run."""
    return bool(getattr(_local, "depth", 0))


@dataclass(frozen=True)
class OpRow:
    """One op that ran: its name, module, phase, and the dtypes in and out."""

    op: str
    module: str
    phase: str
    input_dtypes: tuple[str, ...]
    output_dtype: str
    cast_from: tuple[str, ...] = ()
    category: str = "other"

    @property
    def cast(self) -> bool:
        """True when an input was cast to another dtype inside the trace (autocast does this)."""
        return bool(self.cast_from)


@functools.lru_cache(maxsize=4096)
def category(op: str, inputs: tuple[str, ...], output: str, cast_from: tuple[str, ...]) -> str:
    """lowered / kept / promoted / cast / other, from the dtypes alone."""
    if not _is_float(output):
        return "other"
    floats = [d for d in (*inputs, *cast_from) if _is_float(d)]  # an int cast to float: kept
    if op == "_to_copy" and _is_float(inputs[0] if inputs else "") and inputs[0] != output:
        return "cast"
    bits = {d: torch.finfo(getattr(torch, d)).bits for d in (output, *floats)}
    if bits[output] < 32:
        return "lowered"
    if any(bits[d] < bits[output] for d in floats):
        return "promoted"
    return "kept"


def _is_float(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))


class ModulePaths(Guard):
    """The path of the module running now, from global forward pre/post hooks.

    A Guard: `with ModulePaths() as p:` registers both hooks or neither, and always removes
    them, whatever line an interrupt comes at.
    """

    def __init__(self) -> None:
        super().__init__(self.attach, self.detach)
        self.stack: list[tuple[nn.Module, str]] = []
        self._names: dict[tuple[int, int], str] = {}
        self._handles: list[Any] = []

    def attach(self) -> ModulePaths:
        """Register the two global hooks (call it where interrupts are held back)."""
        self._handles.append(_module.register_module_forward_pre_hook(self._pre))
        self._handles.append(_module.register_module_forward_hook(self._post, always_call=True))
        return self

    def detach(self, _: object = None) -> None:
        """Remove the hooks that attach() registered."""
        while self._handles:
            self._handles.pop().remove()
        self.stack.clear()

    @property
    def current(self) -> str:
        """Dotted path of the innermost running module; the outermost is its class name."""
        return (self.stack[-1][1] or type(self.stack[0][0]).__name__) if self.stack else ""

    def _child_name(self, parent: nn.Module, child: nn.Module) -> str:
        key = (id(parent), id(child))
        if key not in self._names:
            found = next((n for n, m in parent.named_modules() if m is child and n), None)
            self._names[key] = found or f"<{type(child).__name__}>"
        return self._names[key]

    def _pre(self, module: nn.Module, args: Any) -> None:
        for t in tensors(args):  # stop the node labelling of _post at this module's inputs
            _label(t.grad_fn, self.current, walk=False)
        if not self.stack:
            self.stack.append((module, ""))
            return
        parent, ppath = self.stack[-1]
        name = self._child_name(parent, module)
        self.stack.append((module, f"{ppath}.{name}" if ppath else name))

    def _post(self, module: nn.Module, args: Any, out: Any) -> None:
        path = self.current
        while self.stack:  # pop to this module even if an inner one raised
            if self.stack.pop()[0] is module:
                break
        for t in tensors(out):
            _label(t.grad_fn, path, walk=True)


def _label(node: Any, path: str, walk: bool) -> None:
    """Mark the autograd nodes a module created (those not yet marked) with its path."""
    todo = [node]
    while todo:
        n = todo.pop()
        if n is None or _NODE_KEY in n.metadata:
            continue
        n.metadata[_NODE_KEY] = path
        if walk:
            todo.extend(f for f, _ in n.next_functions)


def _op_tensors(args: Any, kwargs: Any) -> list[torch.Tensor]:
    """The tensors among an aten op's arguments: tensors, or lists of them (Tensor[]); an
    op's schema allows nothing deeper, so the general container walker is not needed here
    (it cost more than the rest of the tracer together)."""
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(t for t in a if isinstance(t, torch.Tensor))
    return found


_NAMES: dict[Any, str] = {}  # OpOverload -> "addmm"; dtype -> "bfloat16": both asked per op


def _op_name(func: Any) -> str:
    name = _NAMES.get(func)
    if name is None:
        name = _NAMES[func] = func._schema.name.removeprefix("aten::")
    return name


def _dtype(dtype: torch.dtype) -> str:
    name = _NAMES.get(dtype)
    if name is None:
        name = _NAMES[dtype] = dtype_name(dtype)
    return name


def _row(func: Any, phase: str, module: str, in_dt: tuple[str, ...], out_dt: str,
         cast_from: tuple[str, ...]) -> OpRow:
    """One op's record; a view computes nothing, so it is "other" and passes marks along."""
    op = _op_name(func)
    cat = "other" if func.is_view else category(op, in_dt, out_dt, cast_from)
    return OpRow(op, module, phase, in_dt, out_dt, cast_from, cat)


def _summary_row(func: Any, backward: bool, ins: tuple[torch.dtype, ...],
                 out: torch.dtype | None, cast_from: tuple[str, ...]) -> OpRow:
    return _row(func, "backward" if backward else "forward", "", tuple(map(_dtype, ins)),
                _dtype(out) if out is not None else "", cast_from)


def current_node_module() -> tuple[str, str]:
    """(phase, module) of the op running now: backward ops belong to the module of their node."""
    node = torch._C._current_autograd_node()
    if node is None:
        return "forward", ""
    return "backward", node.metadata.get(_NODE_KEY, "")


class OpWatch(Guard, ContextDecorator, TorchDispatchMode):
    """A dispatch mode that knows the module and phase of each op; subclasses handle ops.

    Entering pushes the mode and registers the module hooks, both or neither; leaving undoes
    both (Guard's enter/exit: no line of its own where an interrupt could cut in). `watch(fn)`
    runs fn inside it with no ampnb line between fn's return and the exit (Python 3.11 runs a
    line event at a `with` on the way out, and an interrupt there skips __exit__).
    """

    def __init__(self, paths: bool = True) -> None:
        Guard.__init__(self, self._attach, self._detach)
        TorchDispatchMode.__init__(self)
        self.paths = ModulePaths()
        self._with_paths = paths  # False: no module hooks, every op's module is ""

    def _attach(self) -> OpWatch:
        if self._with_paths:
            self.paths.attach()
        try:
            TorchDispatchMode.__enter__(self)
        except BaseException:
            self.paths.detach()
            raise
        return self

    def _detach(self, _: object = None) -> None:
        try:
            TorchDispatchMode.__exit__(self, None, None, None)
        finally:
            self.paths.detach()

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch otherwise wraps __torch_dispatch__ in torch._disable_dynamo: a Python wrapper
        # call on every op (and an import of torch._dynamo on the first); nothing is compiled.
        return False

    def where(self) -> tuple[str, str]:
        """(phase, module) of the op being dispatched."""
        phase, module = current_node_module()
        if not self._with_paths:
            return phase, ""
        return phase, (self.paths.current if phase == "forward" else module)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not is_internal():
            self.on_op(func, args, kwargs, out)
        return out

    def on_op(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """Called after every op with its inputs and outputs."""


DETAILS = ("full", "summary")


class OpTrace(TableView, OpWatch):
    """`with trace_ops() as t:` records every op; t.rows, t.counts, t.table()."""

    def __init__(self, limit: int = 100_000, detail: str = "full") -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"limit must be an int >= 0, got {limit!r}")
        if detail not in DETAILS:
            raise ValueError(f"unknown trace detail {detail!r}; allowed: {', '.join(DETAILS)}")
        super().__init__(paths=detail == "full")
        self.detail = detail
        self.limit = limit if detail == "full" else 0
        self.rows: list[OpRow] = []
        self._grouped: Counter[OpRow] = Counter()
        # detail="summary": (func, phase is backward, input dtypes, output dtype, cast marks);
        # names and categories are made once per distinct key, on reading
        self._fast: Counter[tuple] = Counter()
        # cast tensor -> dtype before (a lookup by identity per input, no weak reference made
        # per lookup, no code run when a tensor dies)
        self._source = WeakIdMap()
        self._cast_mark = self._source.get
        self._mark = self._source.__setitem__

    @property
    def grouped(self) -> Counter[OpRow]:
        """How often each distinct row ran (all ops, also past `limit`)."""
        if self._fast:
            for key, n in self._fast.items():
                self._grouped[_summary_row(*key)] += n
            self._fast.clear()
        return self._grouped

    def on_op(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        ins = _op_tensors(args, kwargs)
        outs = [out] if isinstance(out, torch.Tensor) else _op_tensors(
            out if isinstance(out, (list, tuple)) else (), {})
        marks = [self._cast_mark(t) for t in ins] if self._source else []
        if outs and ins:
            if func is _TO_COPY and ins[0].dtype != outs[0].dtype and ins[0].is_floating_point():
                self._mark(outs[0], (marks[0] if marks else None) or _dtype(ins[0].dtype))
            elif func.is_view and marks and marks[0]:
                self._mark(outs[0], marks[0])
        cast_from = () if func.is_view else tuple(dict.fromkeys(m for m in marks if m))
        if self.detail != "full":  # counts only: dtypes kept raw, one C call for the phase
            self._fast[(func, torch._C._current_autograd_node() is not None,
                        tuple(t.dtype for t in ins), outs[0].dtype if outs else None,
                        cast_from)] += 1
            return
        row = _row(func, *self.where(), tuple(_dtype(t.dtype) for t in ins),
                   _dtype(outs[0].dtype) if outs else "", cast_from)
        self._grouped[row] += 1
        if len(self.rows) < self.limit:
            self.rows.append(row)

    @property
    def counts(self) -> dict[str, int]:
        """How many ops fell in each category (all ops, also past `limit`)."""
        c = Counter({k: 0 for k in CATEGORIES})
        for row, n in self.grouped.items():
            c[row.category] += n
        return dict(c)

    def select(self, op: str = "*", module: str = "*", category: str | None = None,
               phase: str | None = None) -> list[OpRow]:
        """Rows whose op and module match glob patterns, optionally of one category/phase."""
        if self.detail != "full":
            raise ValueError("select needs each op's record: trace_ops(detail='full'); this "
                             "trace kept counts only (t.grouped, t.counts, t.table())")
        if category is not None and category not in CATEGORIES:
            raise ValueError(f"unknown category {category!r}; allowed: {', '.join(CATEGORIES)}")
        if phase not in (None, "forward", "backward"):
            raise ValueError(f"unknown phase {phase!r}; allowed: forward, backward")
        return [r for r in self.rows if fnmatch.fnmatchcase(r.op, op)
                and fnmatch.fnmatchcase(r.module, module)
                and category in (None, r.category) and phase in (None, r.phase)]

    def summary(self) -> str:
        """One line: how many ops ran lowered, kept fp32, promoted, and how many casts."""
        c = self.counts
        low = sorted({r.output_dtype for r in self.grouped if r.category == "lowered"})
        low_txt = f" ({', '.join(low)})" if low else ""
        return (f"{sum(c.values())} ops: {c['lowered']} ran in lower precision{low_txt}, "
                f"{c['kept']} kept fp32/fp64, {c['promoted']} promoted to wider floats, "
                f"{c['cast']} casts, {c['other']} views or non-float ops")

    def table(self, limit: int = 60) -> Table:
        """One line per distinct (module, op, phase, dtypes) with how often it ran."""
        items = list(self.grouped.items())
        rows = [(r.module or "-", r.op, r.phase, ", ".join(r.input_dtypes) or "-",
                 r.output_dtype or "-", ", ".join(r.cast_from) or "-", r.category, n)
                for r, n in items[:limit]]
        notes = [self.summary()]
        if len(items) > limit:
            notes.append(f"showing {limit} of {len(items)} distinct rows (table(limit=...))")
        if self.detail == "full" and sum(self.grouped.values()) > len(self.rows):
            notes.append(f"t.rows keeps the first {self.limit} ops; counts include all")
        return Table(("module", "op", "phase", "inputs", "output", "cast from", "category",
                      "count"), rows, caption="ops traced (dtype after autocast)", notes=notes)


def trace_ops(limit: int = 100_000, detail: str = "full") -> OpTrace:
    """`with trace_ops() as t:` records which op ran in which dtype, from which module
    (detail="summary": counts per op and dtypes only, no module paths, no t.rows)."""
    return OpTrace(limit, detail)
