"""Non-finite hunter: the first op that computed inf/NaN from finite inputs."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ampnb._tree import map_tensors, named_leaves, tensors
from ampnb._weak import WeakIdMap
from ampnb.display import Table, TableView, dtype_name
from ampnb.formats import get_format
from ampnb.instruments.trace import OpWatch, internal, is_internal


@dataclass(frozen=True)
class InputRange:
    """One floating input of the blamed op: its range against the op's output format."""

    dtype: str
    shape: tuple[int, ...]
    amax: float          # largest finite magnitude (nan if none)
    finite: bool

    def vs(self, fmt_max: float) -> str:
        """amax as a fraction of the format's max, e.g. '0.0031x max'."""
        return "-" if math.isnan(self.amax * fmt_max) else f"{self.amax / fmt_max:.3g}x max"


@dataclass(frozen=True, eq=False, repr=False)
class NonFinite(TableView):
    """Where inf/NaN was first made from finite values; falsy when no op made any (op, module
    and inputs then say where inf/NaN first came in from outside, if it did)."""

    found: bool
    op: str = ""
    module: str = ""
    phase: str = ""
    output_dtype: str = ""
    format: str = ""
    format_max: float = math.nan
    n_inf: int = 0
    n_nan: int = 0
    count: int = 0
    inputs: tuple[InputRange, ...] = ()
    exact_amax: float = math.nan  # the same op in float64: how large the result really is
    inputs_finite: bool = True    # False: inf/NaN came in from outside (data, weights)
    ops_checked: int = 0
    deliberate: int = 0  # ops given an inf/NaN constant (masked_fill(-inf)): not blamed
    value: Any = field(default=None, repr=False)

    def __bool__(self) -> bool:
        return self.found

    @property
    def message(self) -> str:
        """One line saying what went non-finite, where, and by how much."""
        where = f"{self.op} in {self.module or 'no module'} ({self.phase})"
        what = ", ".join(f"{n} {k}" for n, k in ((self.n_inf, "inf"), (self.n_nan, "NaN")) if n)
        head = f"{self.output_dtype} {where} made {what} of {self.count} values"
        if not self.found:
            aside = (f" ({self.deliberate} wrote inf/NaN constants on purpose, e.g. "
                     "masked_fill(mask, -inf))") if self.deliberate else ""
            none = f"no inf/NaN made from finite values in {self.ops_checked} ops{aside}"
            if not self.op:
                return none
            return (f"{none}; inf/NaN came in from outside the code run (data, weights): "
                    f"first seen entering {where}, which then held {what} of {self.count} "
                    "values")
        if math.isfinite(self.exact_amax):
            return (head + f": in float64 the result reaches {self.exact_amax:.4g}, "
                    f"{self.exact_amax / self.format_max:.3g}x {self.format}'s max "
                    f"{self.format_max:.6g}")
        return head + " from finite inputs"

    def table(self) -> Table:
        """The op's inputs against the output format's max."""
        if not self.op:
            return Table(("result",), [(self.message,)], caption="non-finite hunt")
        rows = [(f"input {i}", r.dtype, "x".join(map(str, r.shape)) or "scalar",
                 f"{r.amax:.4g}", r.vs(self.format_max), "yes" if r.finite else "no")
                for i, r in enumerate(self.inputs)]
        if math.isfinite(self.exact_amax):
            rows.append(("output", self.output_dtype, "-", f"exact {self.exact_amax:.4g}",
                         f"{self.exact_amax / self.format_max:.3g}x max", "no"))
        return Table(("tensor", "dtype", "shape", "amax", f"vs {self.format or 'format'} max",
                      "finite"), rows, caption="non-finite hunt", notes=(self.message,))


def _floats(obj: Any) -> list[torch.Tensor]:
    return [t for t in tensors(obj) if t.is_floating_point() and t.numel()]


def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


def _amax(t: torch.Tensor) -> float:
    a = t.detach().abs()
    a = a[torch.isfinite(a)]
    return a.max().item() if a.numel() else math.nan


def _deliberate(obj: Any) -> bool:
    """True when an op is handed an inf/NaN constant, as attention masks are."""
    return any(isinstance(v, float) and not math.isfinite(v) for _, v in named_leaves(obj))


def _upcast(t: torch.Tensor) -> torch.Tensor:
    return t.double() if t.is_floating_point() else t


def _exact_amax(func: Any, args: Any, kwargs: Any) -> float:
    """The op recomputed in float64 (inputs already rounded); nan when that is not possible."""
    if any(a.alias_info is not None and a.alias_info.is_write and not a.is_out
           for a in func._schema.arguments):
        return math.nan  # in place: the inputs were overwritten, a recomputation would mislead
    try:  # out= is upcast too, so the float64 result has somewhere to go
        outs = _floats(func(*map_tensors(_upcast, args), **map_tensors(_upcast, kwargs)))
    except Exception:  # noqa: BLE001 - not every op accepts float64 (or its kwargs pin a dtype)
        return math.nan
    amaxes = [_amax(o) for o in outs if _finite(o)]
    return max(amaxes) if amaxes else math.nan


def _op_name(func: Any) -> str:
    return func._schema.name.removeprefix("aten::")


# Ops that hand out memory without computing anything: what it holds is whatever was there
# before (often a freed attention mask's -inf). They are never blamed.
_ALLOCATE_PREFIXES = ("empty", "new_empty", "_empty")
_ALLOCATE = frozenset({"resize_", "resize_as_", "set_"})
# In-place ops that overwrite their destination without reading it: it is no input of theirs.
_OVERWRITE = frozenset({"fill_", "zero_", "copy_", "bernoulli_", "uniform_", "normal_",
                        "random_", "exponential_", "geometric_", "cauchy_", "log_normal_"})


def _allocates(name: str) -> bool:
    return name in _ALLOCATE or name.startswith(_ALLOCATE_PREFIXES)


class Hunter(OpWatch):
    """`with Hunter() as h:` checks every op's floating outputs; h.report() names the first.

    Only an op whose floating inputs were all finite and whose computed output is not may be
    blamed. inf/NaN that an op was handed from outside the run (data, weights) is reported
    where it was first seen entering, and the report stays falsy.
    """

    def __init__(self) -> None:
        super().__init__()
        self.result: NonFinite | None = None
        self.seen_from_outside: NonFinite | None = None
        self.ops = self.deliberate = 0
        # Tensors made inside the run that hold (or may hold) inf/NaN: allocations, inf/NaN
        # constants and what flowed from them. inf/NaN in any other input came from outside.
        self._made: WeakIdMap = WeakIdMap()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.result is not None or is_internal():
            return func(*args, **kwargs)
        name = _op_name(func)
        if _allocates(name):
            out = func(*args, **kwargs)
            for t in tensors(out):
                self._made[t] = True
            return out
        schema = func._schema
        written = {a.name for a in schema.arguments if a.is_out}  # out=: written, not read
        overwrite = name in _OVERWRITE and bool(args)
        read_args = args[1:] if overwrite else args
        ins = _floats((read_args, {k: v for k, v in kwargs.items() if k not in written}))
        given = _floats(([kwargs[k] for k in written if k in kwargs], args[:1] if overwrite else ()))
        mutable = schema.is_mutable
        with internal():  # an in-place op overwrites its inputs: look at them before it runs
            bad_before = [t for t in ins if not _finite(t)] if mutable else None
        out = func(*args, **kwargs)
        self.ops += 1
        outs = _floats(out) + given + (ins if mutable else [])
        with internal():  # the checks stay out of a trace running at the same time
            if all(_finite(t) for t in outs):
                return out
            for t in outs:
                self._made[t] = True
            if _deliberate((args, kwargs)):  # masked_fill(mask, -inf): an attention mask
                self.deliberate += 1
                return out
            bad_in = bad_before if mutable else [t for t in ins if not _finite(t)]
            if not bad_in:
                self.result = self._blame(func, args, kwargs, ins, outs, True)
            elif self.seen_from_outside is None and any(t not in self._made for t in bad_in):
                self.seen_from_outside = self._blame(func, args, kwargs, ins, outs, False)
        return out

    def report(self, value: Any = None) -> NonFinite:
        """The first op that made inf/NaN from finite inputs; falsy otherwise (then it still
        says where inf/NaN first came in from outside, if it did)."""
        found = self.result or self.seen_from_outside
        if found is None:
            return NonFinite(False, ops_checked=self.ops, deliberate=self.deliberate, value=value)
        return dataclasses.replace(found, ops_checked=self.ops, deliberate=self.deliberate,
                                   value=value)

    def _blame(self, func: Any, args: Any, kwargs: Any, ins: list[torch.Tensor],
               outs: list[torch.Tensor], finite_in: bool) -> NonFinite:
        bad = next(o for o in outs if not _finite(o))
        fmt = get_format(bad.dtype)
        phase, module = self.where()
        ranges = tuple(InputRange(dtype_name(t.dtype), tuple(t.shape), _amax(t), _finite(t))
                       for t in ins)
        return NonFinite(finite_in, _op_name(func), module, phase, dtype_name(bad.dtype),
                         fmt.name, fmt.max, int(torch.isinf(bad).sum()),
                         int(torch.isnan(bad).sum()), bad.numel(), ranges,
                         _exact_amax(func, args, kwargs) if finite_in else math.nan, finite_in)


def find_nonfinite(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> NonFinite:
    """Run fn(*args, **kwargs) and report the first op that turned finite inputs into inf/NaN."""
    if not callable(fn):
        raise ValueError(f"find_nonfinite needs a function to run (e.g. a forward + backward "
                         f"step), got {type(fn).__name__}")
    hunter = Hunter()
    try:
        value = hunter(fn)(*args, **kwargs)  # not `with`: see OpWatch
    except Exception as e:
        if hunter.result or hunter.seen_from_outside:
            e.add_note(f"ampnb.find_nonfinite: {hunter.report().message}")
        raise
    return hunter.report(value)
