"""Non-finite hunter: the first op that computed inf/NaN from finite inputs that reached the end.

Each tensor produced holding inf/NaN carries a chain: the ops ("origins") its inf/NaN came
from. An op whose output is non-finite passes its non-finite inputs' origins on (or is an
origin itself when its inputs were all finite); an op whose output is finite (torch.where
masking T5's log(0), softmax over an attention mask, a cast to integers) ends those chains.
At report time the cause is the earliest origin of a chain nobody ended (the loss, a gradient,
what the step returned); origins whose chains were all ended are listed as discarded (masked away on purpose, as T5
does, or absorbed by accident, as tanh absorbs an overflowed cube), never blamed.
"""

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
    # ops that made inf/NaN from finite inputs which a later op ended before the end (T5's
    # log(0) under torch.where, an overflow squashed by tanh): discarded, never the cause
    discarded: tuple[NonFinite, ...] = field(default=(), repr=False)

    @property
    def where_text(self) -> str:
        """'float32 log in encoder.block.0 (forward)'."""
        return f"{self.output_dtype} {self.op} in {self.module or 'no module'} ({self.phase})"

    def __bool__(self) -> bool:
        return self.found

    @property
    def message(self) -> str:
        """One line saying what went non-finite, where, and by how much."""
        if not self.discarded:
            return self._message()
        shown = ", ".join(d.where_text for d in self.discarded[:3])
        more = f" and {len(self.discarded) - 3} more" if len(self.discarded) > 3 else ""
        # Whether it was meant (T5's masked log(0)) or not (a cube tanh squashed) is not known here.
        n = len(self.discarded)
        ops = f"{n} {'other ' if self.found else ''}op{'s' if n > 1 else ''}"
        return (f"{self._message()}; {ops} made inf/NaN that was discarded before the end (a "
                f"later op masked or absorbed it; not blamed): {shown}{more}")

    def _message(self) -> str:
        where = f"{self.op} in {self.module or 'no module'} ({self.phase})"
        what = ", ".join(f"{n} {k}" for n, k in ((self.n_inf, "inf"), (self.n_nan, "NaN")) if n)
        head = f"{self.output_dtype} {where} made {what} of {self.count} values"
        if not self.found:
            aside = (f" ({self.deliberate} wrote inf/NaN constants on purpose, e.g. "
                     "masked_fill(mask, -inf))") if self.deliberate else ""
            none = (f"no inf/NaN made from finite values reached the end in {self.ops_checked} "
                    f"ops{aside}")
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


# Ops that read only their input's shape and dtype (backward's ones_like(loss)): they use up
# no inf/NaN, so they end no chain.
_SHAPE_ONLY = frozenset({"ones_like", "zeros_like", "full_like", "rand_like", "randn_like",
                         "randint_like", "new_ones", "new_zeros", "new_full", "scalar_tensor",
                         "ones", "zeros", "full", "sym_size", "sym_numel", "sym_stride"})


def _allocates(name: str) -> bool:
    return name in _ALLOCATE or name.startswith(_ALLOCATE_PREFIXES)


_PENDING, _ON, _ENDED = 0, 1, 2  # a chain's state: nobody used it yet, passed on, ended
_KEEP_ORIGINS = 8  # origins a chain carries at most (those that may be blamed first)


class _Origin:
    """An op where inf/NaN started: 'made' from finite inputs (found says where; the only
    kind ever blamed), 'deliberate' (an inf/NaN constant), 'outside' or 'allocated'."""

    __slots__ = ("found", "kind", "seq")

    def __init__(self, seq: int, kind: str, found: NonFinite | None = None) -> None:
        self.seq, self.kind, self.found = seq, kind, found

    def key(self) -> tuple[bool, int]:
        return (self.kind != "made", self.seq)


class _Chain:
    """What one non-finite op output carries: its origins, and whether it was used."""

    __slots__ = ("origins", "state")

    def __init__(self, origins: tuple[_Origin, ...]) -> None:
        self.origins, self.state = origins, _PENDING


def _ends_chains(out: Any) -> bool:
    """An op with no floating output ends its inputs' chains when it computes values from them
    (a cast to integers); one that only inspects them (isinf, a comparison, .item()) does not."""
    return any(not t.is_floating_point() and t.dtype != torch.bool for t in tensors(out))


class Hunter(OpWatch):
    """`with Hunter() as h:` checks every op's floating outputs; h.report() names the cause.

    The cause is the first op that made inf/NaN from finite inputs whose inf/NaN reached the
    end of the run (the loss, a gradient) through ops whose outputs all held inf/NaN. inf/NaN
    made and then masked or absorbed is listed as discarded, never blamed. inf/NaN that an op was
    handed from outside the run (data, weights) is reported where it was first seen entering,
    and the report stays falsy.
    """

    def __init__(self) -> None:
        super().__init__()
        self.seen_from_outside: NonFinite | None = None
        self.ops = self.deliberate = 0
        # Tensors made inside the run that hold (or may hold) inf/NaN: allocations, inf/NaN
        # constants and what flowed from them. inf/NaN in any other input came from outside.
        self._made: WeakIdMap = WeakIdMap()
        self._chains: WeakIdMap = WeakIdMap()  # non-finite tensor -> its _Chain
        self._all: list[_Chain] = []
        self._origins = 0

    @property
    def result(self) -> NonFinite | None:
        """The cause as things stand (None when no inf/NaN made inside reached the end)."""
        cause, _ = self._settle()
        return cause

    def _origin(self, kind: str, found: NonFinite | None = None) -> _Origin:
        self._origins += 1
        return _Origin(self._origins, kind, found)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if is_internal():
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
        fresh = _floats(out)
        written_to = given + (ins if mutable else [])
        outs = fresh + written_to
        with internal():  # the checks stay out of a trace running at the same time
            if all(_finite(t) for t in outs):
                if self._chains and name not in _SHAPE_ONLY and (outs or _ends_chains(out)):
                    self._end_chains(ins, written_to)
                return out
            for t in outs:
                self._made[t] = True
            bad_in = bad_before if mutable else [t for t in ins if not _finite(t)]
            origins: list[_Origin] = []
            for t in bad_in:
                chain = self._chains.get(t)
                if chain is not None:
                    chain.state = _ON
                    origins.extend(chain.origins)
            if _deliberate((args, kwargs)):  # masked_fill(mask, -inf): an attention mask
                self.deliberate += 1
                origins.append(self._origin("deliberate"))
            elif not bad_in:
                origins.append(self._origin(
                    "made", self._blame(func, args, kwargs, ins, outs, True)))
            elif any(t not in self._made for t in bad_in):
                if self.seen_from_outside is None:
                    self.seen_from_outside = self._blame(func, args, kwargs, ins, outs, False)
                origins.append(self._origin("outside"))
            unique = sorted({id(o): o for o in origins}.values(), key=_Origin.key)
            chain = _Chain(tuple(unique[:_KEEP_ORIGINS]))
            self._all.append(chain)
            for t in outs:
                if _finite(t):
                    self._chains.pop(t)
                else:
                    self._chains[t] = chain
        return out

    def _end_chains(self, ins: list, written_to: list) -> None:
        """A finite result: the inputs' inf/NaN was used up here (masked away, cast), and a tensor
        written to no longer carries a chain."""
        for t in ins:
            chain = self._chains.get(t)
            if chain is not None and chain.state == _PENDING:
                chain.state = _ENDED
        for t in written_to:
            self._chains.pop(t)

    def _settle(self) -> tuple[NonFinite | None, tuple[NonFinite, ...]]:
        """(the cause, the inf/NaN made and discarded) from the chains as they stand."""
        reached: dict[int, _Origin] = {}
        ended: dict[int, _Origin] = {}
        for chain in self._all:
            if chain.state == _ON:
                continue
            into = reached if chain.state == _PENDING else ended
            for o in chain.origins:
                if o.kind == "made":
                    into[id(o)] = o
        cause = min(reached.values(), key=_Origin.key, default=None)
        discarded = sorted((o for k, o in ended.items() if k not in reached), key=_Origin.key)
        return (cause.found if cause else None), tuple(o.found for o in discarded if o.found)

    def report(self, value: Any = None) -> NonFinite:
        """The first op that made inf/NaN from finite inputs that reached the end; falsy
        otherwise (then it still says where inf/NaN first came in from outside, if it did).
        Either way `discarded` lists the inf/NaN that later ops masked or absorbed."""
        cause, discarded = self._settle()
        found = cause or self.seen_from_outside
        if found is None:
            return NonFinite(False, ops_checked=self.ops, deliberate=self.deliberate, value=value,
                             discarded=discarded)
        return dataclasses.replace(found, ops_checked=self.ops, deliberate=self.deliberate,
                                   value=value, discarded=discarded)

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
    """Run fn(*args, **kwargs) and report the first op that turned finite inputs into inf/NaN
    which then reached the end (loss, gradients); inf/NaN masked or absorbed is listed as discarded."""
    if not callable(fn):
        raise ValueError(f"find_nonfinite needs a function to run (e.g. a forward + backward "
                         f"step), got {type(fn).__name__}")
    hunter = Hunter()
    try:
        value = hunter(fn)(*args, **kwargs)  # not `with`: see OpWatch
    except Exception as e:
        found = hunter.report()
        if found or found.op:
            e.add_note(f"ampnb.find_nonfinite: {found.message}")
        raise
    return hunter.report(value)
