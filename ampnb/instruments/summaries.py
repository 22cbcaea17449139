"""Summaries of tensors: coverage in several formats and a log2 histogram, computed together."""

from __future__ import annotations

import dataclasses
import math
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
    """A captured tensor waiting for its summary. Its |x| was staged at hook time (a private
    copy, so later in-place ops, ReLU(inplace=True) or optimizer.zero_grad, cannot change
    what was seen): elements [start, start + count) of buf. (A NamedTuple: one is made for
    every tensor a hook sees, and a frozen dataclass costs several times more to make.)"""

    buf: torch.Tensor
    start: int
    count: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    name: str
    kind: str
    module: str
    calls: int = 1
    tensor: torch.Tensor | None = None  # an exact copy, only with keep=True


_STAGE = 1 << 20   # elements (float32) of one staging buffer
_SPARE = 4         # CPU staging buffers kept between captures: fresh memory costs a pass
_FREE: list[torch.Tensor] = []


class _Stage:
    """Where |x| of each captured tensor is written once, at hook time, in the form counting
    starts from (float32, or float64 for float64 tensors): nothing is concatenated,
    converted or masked later. Short and long tensors fill separate buffers, so the short
    ones stay contiguous and are counted together."""

    def __init__(self) -> None:
        self._open: dict[tuple, list] = {}  # (device, long) -> [buffer, elements used]
        self._taken: list[torch.Tensor] = []  # pooled buffers, given back by release()

    def put(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Stage |x|; returns (buffer, start)."""
        if not torch._C._len_torch_dispatch_stack():
            return self._put(x)
        with internal():  # hide the copy from a tracer or hunter
            return self._put(x)

    def _put(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        n, x = x.numel(), x.detach()
        if x.dtype == torch.float64 or n > _STAGE:  # a buffer of its own
            buf = torch.empty(n, dtype=_WORK.get(x.dtype, torch.float32), device=x.device)
            _abs_into(x, buf)
            return buf, 0
        where = (x.device, n >= _bitkeys._ALONE)
        slot = self._open.get(where)
        if slot is None or slot[1] + n > _STAGE:
            slot = self._open[where] = [self._take(x.device), 0]
        buf, start = slot
        slot[1] = start + n
        _abs_into(x, buf[start:start + n])
        return buf, start

    def _take(self, device: torch.device) -> torch.Tensor:
        if device.type == "cpu":
            try:
                buf = _FREE.pop()
            except IndexError:
                buf = torch.empty(_STAGE)
            self._taken.append(buf)
            return buf
        return torch.empty(_STAGE, device=device)  # the caching allocator reuses memory

    def release(self) -> None:
        """Give the pooled buffers back; call only when no staged view is used any more."""
        self._open.clear()
        while self._taken:
            buf = self._taken.pop()
            if len(_FREE) < _SPARE:
                _FREE.append(buf)


_WORK = {torch.float64: torch.float64}


def _abs_into(x: torch.Tensor, out: torch.Tensor) -> None:
    """out (flat) = |x|: abs clears the sign bit, NaN's too (the counting reads bits)."""
    if x.dim() > 1:
        out = out.view(*x.shape)  # (unpacked: a torch.Size argument takes a slow path)
    elif not x.dim():
        x = x.reshape(1)
    if x.dtype == out.dtype:
        torch.abs(x, out=out)
    else:  # narrower formats widen exactly, then drop the sign
        out.copy_(x).abs_()


def summarize_many(seen: Iterable[_Seen], formats: Iterable[str] = DEFAULT_FORMATS
                   ) -> list[TensorStats]:
    """Summaries of many staged tensors: one segmented pass per run of contiguous segments."""
    fmts = tuple(get_format(f) for f in formats)
    seen = list(seen)
    bufs: dict[int, tuple[torch.Tensor, dict[int, int]]] = {}  # id -> (buffer, {start: n})
    for s in seen:
        if s.count:  # an empty output is a fact to show, not an error in a hook
            bufs.setdefault(id(s.buf), (s.buf, {}))[1][s.start] = s.count
    found: dict[tuple[int, int], tuple] = {}
    with internal():  # on private staged copies: no autograd to switch off
        for i, (buf, segs) in bufs.items():
            for first, lengths in _runs(segs):
                stats = segment_stats(buf[first:first + sum(lengths)], lengths,
                                      fmts or (buf.dtype,), absolute=True)
                start = first
                for n, st in zip(lengths, stats):
                    found[(i, start)] = st
                    start += n
    names = {f.name: None for f in fmts}
    out = []
    for s in seen:
        covs, hist = found.get((id(s.buf), s.start), _NONE) if s.count else _NONE
        c0 = next(iter(covs.values()), None)  # amax and min |x| are the same in every format
        out.append(_stats(
            s.name, s.module, s.kind, s.shape, _dtype(s.dtype), s.count,
            c0.amax if c0 else math.nan, c0.min_nonzero if c0 else math.nan,
            tuple(hist), tuple(covs[f] for f in names) if c0 else (), s.calls, s.tensor))
    return out


_NONE: tuple = ({}, ())
_FIELDS = tuple(f.name for f in dataclasses.fields(TensorStats))


def _stats(*values: object) -> TensorStats:
    """TensorStats(*values), set in one step (a frozen dataclass's __init__ sets each field
    on its own, which costs more than the rest of a record's bookkeeping)."""
    t = object.__new__(TensorStats)
    t.__dict__.update(zip(_FIELDS, values))
    return t


def _runs(segs: dict[int, int]) -> list[tuple[int, list[int]]]:
    """(first start, lengths) of each run of back-to-back segments (a capture kept attached
    over several calls leaves gaps where a later call's copy replaced an earlier one)."""
    runs: list[tuple[int, list[int]]] = []
    end = -1
    for start in sorted(segs):
        if start != end:
            runs.append((start, []))
        runs[-1][1].append(segs[start])
        end = start + segs[start]
    return runs


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
    stage = _Stage()
    out = summarize_many([stage_one(stage, x, name, kind, module, keep)], formats)[0]
    stage.release()
    return out


def stage_one(stage: _Stage, x: torch.Tensor, name: str, kind: str, module: str,
              keep: bool = False, calls: int = 1) -> _Seen:
    """x staged for a later summary (and copied exactly too with keep)."""
    buf, start = stage.put(x) if x.numel() else (_EMPTY, 0)
    return _Seen(buf, start, x.numel(), tuple(x.shape), x.dtype, name, kind, module, calls,
                 _copy(x) if keep else None)


_EMPTY = torch.empty(0)


def _check_float(x: object) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"summarize needs a floating-point tensor, got "
                         f"{getattr(x, 'dtype', type(x).__name__)}")


def _copy(x: torch.Tensor) -> torch.Tensor:
    if not torch._C._len_torch_dispatch_stack():  # no tracer or hunter to hide the copy from
        return x.detach().clone()
    with internal():
        return x.detach().clone()
