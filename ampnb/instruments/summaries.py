"""Summaries of tensors: coverage in several formats and a log2 histogram, computed together."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ampnb.display import dtype_name
from ampnb.formats import get_format
from ampnb.instruments import _bitkeys
from ampnb.instruments.coverage_stats import Coverage, segment_stats
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
    histogram: tuple[int, ...]  # counts over EXP_BINS
    coverages: tuple[Coverage, ...]
    calls: int = 1  # how many captured calls saw this tensor; the stats are of the last one
    tensor: torch.Tensor | None = None  # kept only with capture(..., keep=True)

    def coverage(self, fmt: str) -> Coverage:
        """This tensor's coverage in one of the captured formats."""
        name = get_format(fmt).name
        for c in self.coverages:
            if c.format == name:
                return c
        raise ValueError(f"format {fmt!r} was not captured; captured: "
                         f"{', '.join(c.format for c in self.coverages)}")


class _Seen(NamedTuple):
    """A captured tensor waiting for its summary. flat is |x|, flattened, copied at hook time
    (so later in-place ops, ReLU(inplace=True) or optimizer.zero_grad, cannot change what
    was seen), in the form counting starts from. (A NamedTuple: one is made for every
    tensor a hook sees, and a frozen dataclass costs several times more to make.)"""

    flat: torch.Tensor
    shape: tuple[int, ...]
    dtype: torch.dtype
    name: str
    kind: str
    module: str
    calls: int = 1
    tensor: torch.Tensor | None = None  # an exact copy, only with keep=True


_KEPT = (torch.float32, torch.float64)  # counted in their own dtype; the rest in float32


def _stage(x: torch.Tensor) -> torch.Tensor:
    """|x| as a private flat copy: abs clears the sign bit, NaN's too, so the counting
    starts from these bits as they are. One pass, like the copy it replaces."""
    if not torch._C._len_torch_dispatch_stack():
        return _abs_copy(x)
    with internal():  # hide the copy from a tracer or hunter
        return _abs_copy(x)


def _abs_copy(x: torch.Tensor) -> torch.Tensor:
    x = x.detach().ravel()  # (ravel: a third of reshape(-1)'s cost here, same result)
    # float32 and float64 make a new tensor with abs; narrower formats widen exactly first
    return x.abs() if x.dtype in _KEPT else x.float().abs_()


_SCRATCH: list[torch.Tensor] = []  # one float32 buffer the short tensors are joined in
_SCRATCH_LOCK = threading.Lock()


def summarize_many(seen: Iterable[_Seen], formats: Iterable[str] = DEFAULT_FORMATS
                   ) -> list[TensorStats]:
    """Summaries of many staged tensors: the short ones of a device and dtype joined and
    counted in one segmented pass, each long one where it lies."""
    fmts = tuple(get_format(f) for f in formats)
    seen = list(seen)
    groups: dict[tuple, dict[int, tuple[torch.Tensor, int]]] = {}  # (copy, n) per distinct copy
    for s in seen:
        f = s.flat
        n = f.numel()
        if n:  # an empty output is a fact to show, not an error in a hook
            groups.setdefault((f.device, f.dtype), {})[id(f)] = (f, n)
    found: dict[int, tuple] = {}
    alone = _bitkeys._ALONE
    with internal():  # on private copies: no autograd to switch off
        for (_, dt), flats in groups.items():
            for i, (f, n) in flats.items():
                if n >= alone:
                    found[i] = segment_stats(f, [n], fmts or (dt,), absolute=True)[0]
            # ordered by length: the per-segment extremes then take a call per length
            short = sorted(((n, i, f) for i, (f, n) in flats.items() if n < alone),
                           key=lambda item: item[0])
            if short:
                stats = _joined_stats([f for _, _, f in short], [n for n, _, _ in short],
                                      fmts or (dt,))
                found.update(zip((i for _, i, _ in short), stats))
    names = tuple({f.name: None for f in fmts})
    out = []
    for s in seen:
        covs, hist = found.get(id(s.flat), _NONE)
        c0 = next(iter(covs.values())) if covs else None  # amax, min |x|: same in every format
        out.append(_stats(
            s.name, s.module, s.kind, s.shape, _dtype(s.dtype), s.flat.numel(),
            c0.amax if c0 else math.nan, c0.min_nonzero if c0 else math.nan,
            tuple(hist), tuple([covs[f] for f in names]) if c0 else (), s.calls, s.tensor))
    return out


def _joined_stats(flats: list[torch.Tensor], lengths: list[int], fmts: tuple) -> list[tuple]:
    """segment_stats of short flat tensors joined by one cat (into a kept buffer on CPU:
    fresh memory costs more than the copy)."""
    n = sum(lengths)
    if flats[0].is_cpu and flats[0].dtype == torch.float32 and n <= _bitkeys._CHUNK and \
            _SCRATCH_LOCK.acquire(blocking=False):
        try:
            if not _SCRATCH or _SCRATCH[0].numel() < n:
                _SCRATCH[:] = [torch.empty(max(n, 1 << 16))]
            flat = torch.cat(flats, out=_SCRATCH[0][:n]) if len(flats) > 1 else flats[0]
            return segment_stats(flat, lengths, fmts, absolute=True)
        finally:
            _SCRATCH_LOCK.release()
    flat = torch.cat(flats) if len(flats) > 1 else flats[0]
    return segment_stats(flat, lengths, fmts, absolute=True)


_NONE: tuple = ({}, ())  # (coverages, histogram) of an empty tensor


def _stats(name: str, module: str, kind: str, shape: tuple[int, ...], dtype: str, count: int,
           amax: float, min_nonzero: float, histogram: tuple[int, ...],
           coverages: tuple[Coverage, ...], calls: int, tensor: torch.Tensor | None
           ) -> TensorStats:
    """TensorStats(...) with its fields set in one step (a frozen dataclass's __init__ sets
    them one by one, which costs more than the rest of a record's bookkeeping)."""
    t = object.__new__(TensorStats)
    object.__setattr__(t, "__dict__", {
        "name": name, "module": module, "kind": kind, "shape": shape, "dtype": dtype,
        "count": count, "amax": amax, "min_nonzero": min_nonzero, "histogram": histogram,
        "coverages": coverages, "calls": calls, "tensor": tensor})
    return t


_DTYPES: dict[torch.dtype, str] = {}


def _dtype(dtype: torch.dtype) -> str:
    name = _DTYPES.get(dtype)
    if name is None:
        name = _DTYPES[dtype] = dtype_name(dtype)
    return name


def summarize(x: torch.Tensor, formats: Iterable[str] = DEFAULT_FORMATS, name: str = "",
              kind: str = "activation", module: str = "", keep: bool = False) -> TensorStats:
    """Summaries of one tensor, computed on its own device; only small numbers come back."""
    _check_float(x)
    seen = _Seen(_stage(x), tuple(x.shape), x.dtype, name, kind, module, 1,
                 _copy(x) if keep else None)
    return summarize_many([seen], formats)[0]


def _check_float(x: object) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"summarize needs a floating-point tensor, got "
                         f"{getattr(x, 'dtype', type(x).__name__)}")


def _copy(x: torch.Tensor) -> torch.Tensor:
    if not torch._C._len_torch_dispatch_stack():  # no tracer or hunter to hide the copy from
        return x.detach().clone()
    with internal():
        return x.detach().clone()
