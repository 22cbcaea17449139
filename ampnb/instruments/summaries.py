"""Summaries of tensors: coverage in several formats and a log2 histogram, computed together."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ampnb.display import dtype_name
from ampnb.formats import get_format
from ampnb.instruments._bitkeys import _ALONE
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


@dataclass(frozen=True, eq=False)
class _Seen:
    """A captured tensor waiting for its summary: a private copy, so later in-place ops
    (ReLU(inplace=True), optimizer.zero_grad) cannot change what was seen."""

    tensor: torch.Tensor
    name: str
    kind: str
    module: str
    calls: int = 1


def summarize_many(seen: Iterable[_Seen], formats: Iterable[str] = DEFAULT_FORMATS,
                   keep: bool = False) -> list[TensorStats]:
    """Summaries of many tensors: one segmented pass per (device, dtype) group."""
    fmts = tuple(get_format(f) for f in formats)
    seen = list(seen)
    groups: dict[tuple, dict[int, torch.Tensor]] = {}  # one segment per distinct tensor
    for s in seen:
        t = s.tensor
        if t.numel():  # an empty output is a fact to show, not an error in a hook
            key = (t.device, torch.float64 if t.dtype == torch.float64 else torch.float32)
            groups.setdefault(key, {})[id(t)] = t
    found: dict[int, tuple] = {}
    with internal():  # on private detached copies: no autograd to switch off
        for (_, dt), tensors in groups.items():
            # A long tensor is counted where it lies; short ones after one cat and one
            # conversion (a copy costs as much as a counting pass).
            short = {i: t for i, t in tensors.items() if t.numel() < _ALONE}
            parts = [({i: t}, t.reshape(-1)) for i, t in tensors.items() if i not in short]
            if short:
                parts.append((short, torch.cat([t.reshape(-1) for t in short.values()])))
            for ts, flat in parts:
                stats = segment_stats(flat.to(dt), [t.numel() for t in ts.values()],
                                      fmts or (dt,))
                found.update(zip(ts, stats))
    names = {f.name: None for f in fmts}
    out = []
    for s in seen:
        t = s.tensor
        covs, hist = found.get(id(t), ({}, ()))
        c0 = next(iter(covs.values()), None)  # amax and min |x| are the same in every format
        out.append(TensorStats(
            s.name, s.module, s.kind, tuple(t.shape), _dtype(t.dtype),
            t.numel(), c0.amax if c0 else math.nan, c0.min_nonzero if c0 else math.nan,
            tuple(hist), tuple(covs[f] for f in names) if c0 else (), s.calls,
            tensor=t if keep else None))
    return out


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
    return summarize_many([_Seen(_copy(x), name, kind, module)], formats, keep)[0]


def _check_float(x: object) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"summarize needs a floating-point tensor, got "
                         f"{getattr(x, 'dtype', type(x).__name__)}")


def _copy(x: torch.Tensor) -> torch.Tensor:
    if not torch._C._len_torch_dispatch_stack():  # no tracer or hunter to hide the copy from
        return x.detach().clone()
    with internal():
        return x.detach().clone()
