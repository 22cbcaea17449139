"""Non-finite hunter: the first op whose output went inf/NaN while its inputs were finite."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ampnb.display import Table
from ampnb.formats import get_format
from ampnb.instruments.trace import OpWatch, internal, is_internal, tensors_in


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


@dataclass(frozen=True, eq=False)
class NonFinite:
    """Where inf/NaN first appeared; falsy when nothing went non-finite."""

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
        if not self.found:
            aside = (f" ({self.deliberate} wrote inf/NaN constants on purpose, e.g. "
                     "masked_fill(mask, -inf))") if self.deliberate else ""
            return f"no inf/NaN made from finite values in {self.ops_checked} ops{aside}"
        where = f"{self.op} in {self.module or 'no module'} ({self.phase})"
        what = ", ".join(f"{n} {k}" for n, k in ((self.n_inf, "inf"), (self.n_nan, "NaN")) if n)
        head = f"{self.output_dtype} {where} made {what} of {self.count} values"
        if not self.inputs_finite:
            return head + ": its inputs already held inf/NaN, from outside the code run"
        if math.isfinite(self.exact_amax):
            return (head + f": in float64 the result reaches {self.exact_amax:.4g}, "
                    f"{self.exact_amax / self.format_max:.3g}x {self.format}'s max "
                    f"{self.format_max:.6g}")
        return head + " from finite inputs"

    def table(self) -> Table:
        """The blamed op's inputs against the output format's max."""
        rows = [(f"input {i}", r.dtype, "x".join(map(str, r.shape)) or "scalar",
                 f"{r.amax:.4g}", r.vs(self.format_max), "yes" if r.finite else "no")
                for i, r in enumerate(self.inputs)]
        if math.isfinite(self.exact_amax):
            rows.append(("output", self.output_dtype, "-", f"exact {self.exact_amax:.4g}",
                         f"{self.exact_amax / self.format_max:.3g}x max", "no"))
        return Table(("tensor", "dtype", "shape", "amax", f"vs {self.format or 'format'} max",
                      "finite"), rows, caption="non-finite hunt", notes=(self.message,))

    def _repr_html_(self) -> str:
        return self.table()._repr_html_()

    def __repr__(self) -> str:
        return repr(self.table()) if self.found else self.message


def _floats(obj: Any) -> list[torch.Tensor]:
    return [t for t in tensors_in(obj) if t.is_floating_point() and t.numel()]


def _all_finite(ts: list[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in ts)


def _amax(t: torch.Tensor) -> float:
    a = t.detach().abs()
    a = a[torch.isfinite(a)]
    return a.max().item() if a.numel() else math.nan


def _deliberate(obj: Any) -> bool:
    """True when an op is handed an inf/NaN constant, as attention masks are."""
    if isinstance(obj, float):
        return not math.isfinite(obj)
    if isinstance(obj, (list, tuple)):
        return any(_deliberate(v) for v in obj)
    if isinstance(obj, dict):
        return any(_deliberate(v) for v in obj.values())
    return False


def _upcast(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.double() if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_upcast(v) for v in obj)
    if isinstance(obj, dict):  # out= too, so the float64 result has somewhere to go
        return {k: _upcast(v) for k, v in obj.items()}
    return obj


def _exact_amax(func: Any, args: Any, kwargs: Any) -> float:
    """The op recomputed in float64 (inputs already rounded); nan when that is not possible."""
    if any(a.alias_info is not None and a.alias_info.is_write and not a.is_out
           for a in func._schema.arguments):
        return math.nan  # in place: the inputs were overwritten, a recomputation would mislead
    try:
        outs = _floats(func(*_upcast(args), **_upcast(kwargs)))
    except Exception:  # noqa: BLE001 - not every op accepts float64 (or its kwargs pin a dtype)
        return math.nan
    amaxes = [_amax(o) for o in outs if bool(torch.isfinite(o).all())]
    return max(amaxes) if amaxes else math.nan


class Hunter(OpWatch):
    """`with Hunter() as h:` checks every op's floating outputs; h.report() names the first."""

    def __init__(self) -> None:
        super().__init__()
        self.result: NonFinite | None = None
        self.seen_from_outside: NonFinite | None = None
        self.ops = self.deliberate = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.result is not None or is_internal():
            return func(*args, **kwargs)
        mutable = func._schema.is_mutable
        written = {a.name for a in func._schema.arguments if a.is_out}  # out=: not read
        ins = _floats((args, {k: v for k, v in kwargs.items() if k not in written}))
        outs_given = _floats([kwargs[k] for k in written if k in kwargs])
        with internal():  # an in-place op overwrites its inputs: look at them before it runs
            before = _all_finite(ins) if mutable else None
        out = func(*args, **kwargs)
        self.ops += 1
        outs = _floats(out) + outs_given + (ins if mutable else [])
        with internal():  # the checks stay out of a trace running at the same time
            if _all_finite(outs):
                return out
            if _deliberate((args, kwargs)):  # masked_fill(mask, -inf): an attention mask
                self.deliberate += 1
                return out
            finite_in = before if mutable else _all_finite(ins)
            found = self._blame(func, args, kwargs, ins, outs, finite_in)
        if finite_in:
            self.result = found
        elif self.seen_from_outside is None:
            self.seen_from_outside = found
        return out

    def report(self, value: Any = None) -> NonFinite:
        """The first op that made inf/NaN from finite inputs (else where inf/NaN came in)."""
        found = self.result or self.seen_from_outside
        if found is None:
            return NonFinite(False, ops_checked=self.ops, deliberate=self.deliberate, value=value)
        return dataclasses.replace(found, ops_checked=self.ops, deliberate=self.deliberate,
                                   value=value)

    def _blame(self, func: Any, args: Any, kwargs: Any, ins: list[torch.Tensor],
               outs: list[torch.Tensor], finite_in: bool) -> NonFinite:
        bad = next(o for o in outs if not bool(torch.isfinite(o).all()))
        fmt = get_format(bad.dtype)
        phase, module = self.where()
        ranges = tuple(InputRange(str(t.dtype)[6:], tuple(t.shape), _amax(t),
                                  bool(torch.isfinite(t).all())) for t in ins)
        return NonFinite(True, func._schema.name.removeprefix("aten::"), module, phase,
                         str(bad.dtype)[6:], fmt.name, fmt.max, int(torch.isinf(bad).sum()),
                         int(torch.isnan(bad).sum()), bad.numel(), ranges,
                         _exact_amax(func, args, kwargs) if finite_in else math.nan, finite_in)


def find_nonfinite(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> NonFinite:
    """Run fn(*args, **kwargs) and report the first op that turned finite inputs into inf/NaN."""
    if not callable(fn):
        raise ValueError(f"find_nonfinite needs a function to run (e.g. a forward + backward "
                         f"step), got {type(fn).__name__}")
    hunter = Hunter()
    try:
        with hunter:
            value = fn(*args, **kwargs)
    except Exception as e:
        if hunter.result is not None:
            e.add_note(f"ampnb.find_nonfinite: {hunter.result.message}")
        raise
    return hunter.report(value)
