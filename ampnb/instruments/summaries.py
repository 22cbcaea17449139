"""Summaries of tensors: coverage in several formats and a log2 histogram, computed together."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ampnb.display import dtype_name
from ampnb.formats import get_format
from ampnb.instruments.coverage_stats import Coverage, SegmentCounts, segment_counts
from ampnb.instruments.trace import internal

KINDS = ("weight", "activation", "gradient", "activation_gradient")
DEFAULT_FORMATS = ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True, eq=False)
class TensorStats:
    """One captured tensor: where it came from and how its values sit against the formats."""

    name: str   # module path plus parameter name or output index, e.g. "body.0.weight"
    module: str
    kind: str
    shape: tuple[int, ...]
    dtype: str
    count: int
    amax: float
    min_nonzero: float
    calls: int = 1  # how many captured calls saw this tensor; the stats are of the last one
    tensor: torch.Tensor | None = None  # kept only with capture(..., keep=True)
    # (the count table shared with the tensors counted together, this tensor's row in it)
    counts: tuple[SegmentCounts, int] | None = field(default=None, repr=False)

    @functools.cached_property
    def histogram(self) -> tuple[int, ...]:
        """Counts over EXP_BINS (built from the shared count table at the first look)."""
        if self.counts is None:
            return ()
        table, row = self.counts
        return table.histogram(row)

    @functools.cached_property
    def coverages(self) -> tuple[Coverage, ...]:
        """Coverage in each captured format, in the order asked for."""
        if self.counts is None:
            return ()
        table, row = self.counts
        return tuple(table.coverages(row).values())

    def coverage(self, fmt: str) -> Coverage:
        """This tensor's coverage in one of the captured formats."""
        name = get_format(fmt).name
        for c in self.coverages:
            if c.format == name:
                return c
        raise ValueError(f"format {fmt!r} was not captured; captured: "
                         f"{', '.join(c.format for c in self.coverages)}")


class Staged(NamedTuple):
    """A captured tensor waiting for its summary. flat_abs is |x|, flattened, copied at hook
    time (so later in-place ops, ReLU(inplace=True) or optimizer.zero_grad, cannot change
    what was seen), in the form counting starts from. (A NamedTuple: one is made for every
    tensor a hook sees, and a frozen dataclass costs several times more to make.)"""

    flat_abs: torch.Tensor
    shape: tuple[int, ...]
    dtype: torch.dtype
    name: str
    kind: str
    module: str
    calls: int = 1
    tensor: torch.Tensor | None = None  # an exact copy, only with keep=True


_OWN_DTYPE = (torch.float32, torch.float64)  # counted in their own dtype; the rest in float32


def _hidden(fn, *args):
    """fn(*args), hidden from a tracer or hunter when one is watching (the private copies of
    capture are not the user's ops); no context to enter when none is, as in most steps."""
    if not torch._C._len_torch_dispatch_stack():
        return fn(*args)
    with internal():
        return fn(*args)


def stage(x: torch.Tensor) -> torch.Tensor:
    """|x| as a private flat copy: abs clears the sign bit, NaN's too, so the counting
    starts from these bits as they are. One pass, like the copy it replaces."""
    return _hidden(_abs_copy, x)


def stage_many(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """stage() of many tensors at once: |x| of each as a flat view of one private buffer per
    device and counting dtype, filled by one cat and one abs (a copy each costs a few
    dispatcher calls, which add up over every parameter of a model)."""
    return _hidden(_abs_views, xs)


def exact_copy(x: torch.Tensor) -> torch.Tensor:
    """A private exact copy of x, kept with keep=True."""
    return _hidden(_clone, x)


def _clone(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone()


def _abs_views(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """|x| of each tensor as flat views of one buffer per (device, counting dtype)."""
    groups: dict[tuple, list[int]] = {}
    for i, x in enumerate(xs):
        groups.setdefault((x.device, x.dtype if x.dtype in _OWN_DTYPE else torch.float32),
                          []).append(i)
    out: list[torch.Tensor] = [None] * len(xs)  # type: ignore[list-item]
    with torch.no_grad():  # (cheaper than a detach per tensor)
        for (device, dtype), indices in groups.items():
            parts = [xs[i].reshape(-1) for i in indices]
            lengths = [t.numel() for t in parts]
            flat = torch.empty(sum(lengths), dtype=dtype, device=device)
            torch.cat(parts, out=flat).abs_()  # cat widens narrower formats exactly
            for i, view in zip(indices, flat.split(lengths)):
                out[i] = view
    return out


def _abs_copy(x: torch.Tensor) -> torch.Tensor:
    x = x.detach().ravel()  # (ravel: a third of reshape(-1)'s cost here, same result)
    # float32 and float64 make a new tensor with abs; narrower formats widen exactly first
    return x.abs() if x.dtype in _OWN_DTYPE else x.float().abs_()


def summarize_many(staged: Iterable[Staged], formats: Iterable[str] = DEFAULT_FORMATS
                   ) -> list[TensorStats]:
    """Summaries of many staged tensors: those of one device and dtype counted together (the
    short ones joined in one segmented pass, each long one where it lies)."""
    fmts = tuple(get_format(f) for f in formats)
    staged = list(staged)
    groups: dict[tuple, dict[int, torch.Tensor]] = {}  # per distinct copy
    for s in staged:
        flat = s.flat_abs
        if flat.numel():  # an empty output is a fact to show, not an error in a hook
            groups.setdefault((flat.device, flat.dtype), {})[id(flat)] = flat
    found: dict[int, tuple[SegmentCounts, int]] = {}  # id of a copy: (count table, its row)
    with internal():  # on private copies: no autograd to switch off
        for flats in groups.values():
            # shortest first: the short ones then make one run, joined and counted together
            order = sorted(flats, key=lambda i: flats[i].numel())
            counts = segment_counts([flats[i] for i in order], fmts, absolute=True)
            found.update((i, (counts, row)) for row, i in enumerate(order))
    out = []
    for s in staged:
        at = found.get(id(s.flat_abs))
        if at is None:  # empty: nothing to count
            amax = min_nonzero = math.nan
        else:
            counts, row = at
            amax, min_nonzero = counts.amax[row], counts.min_nonzero[row]
        out.append(_tensor_stats(s.name, s.module, s.kind, s.shape, _dtype_label(s.dtype),
                                 s.flat_abs.numel(), amax, min_nonzero, s.calls, s.tensor, at))
    return out


def _tensor_stats(name: str, module: str, kind: str, shape: tuple[int, ...], dtype: str,
                  count: int, amax: float, min_nonzero: float, calls: int,
                  tensor: torch.Tensor | None, counts: tuple[SegmentCounts, int] | None
                  ) -> TensorStats:
    """TensorStats(...) with its fields set in one step (a frozen dataclass's __init__ sets
    them one by one, which costs more than the rest of a record's bookkeeping)."""
    t = object.__new__(TensorStats)
    object.__setattr__(t, "__dict__", {
        "name": name, "module": module, "kind": kind, "shape": shape, "dtype": dtype,
        "count": count, "amax": amax, "min_nonzero": min_nonzero, "calls": calls,
        "tensor": tensor, "counts": counts})
    return t


_DTYPE_LABELS: dict[torch.dtype, str] = {}


def _dtype_label(dtype: torch.dtype) -> str:
    """dtype_name(dtype), remembered: it runs for every record."""
    label = _DTYPE_LABELS.get(dtype)
    if label is None:
        label = _DTYPE_LABELS[dtype] = dtype_name(dtype)
    return label


def summarize(x: torch.Tensor, formats: Iterable[str] = DEFAULT_FORMATS, name: str = "",
              kind: str = "activation", module: str = "", keep: bool = False) -> TensorStats:
    """Summaries of one tensor, computed on its own device; only small numbers come back."""
    _check_float(x)
    staged = Staged(stage(x), tuple(x.shape), x.dtype, name, kind, module, 1,
                    exact_copy(x) if keep else None)
    return summarize_many([staged], formats)[0]


def _check_float(x: object) -> None:
    """ValueError unless x is a floating-point tensor."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"summarize needs a floating-point tensor, got "
                         f"{getattr(x, 'dtype', type(x).__name__)}")
