"""Which kernel turns float32 bits into coverage keys on CPU: eager torch ops, or one compiled pass."""

from __future__ import annotations

import math

import torch

from ampnb.formats import FORMATS, get_format
from ampnb.instruments import _bitkeys as bk

BACKENDS = ("eager", "compiled")
_STATE = bk._BACKEND  # the selection lives beside the code that reads it


def coverage_backend(name: str | None = None) -> str:
    """Get, or set, the CPU kernel of coverage/capture: "eager" (default) or "compiled"."""
    if name is None:
        return str(_STATE["name"])
    if name not in BACKENDS:
        raise ValueError(f"unknown coverage backend {name!r}; allowed: {', '.join(BACKENDS)}")
    if name == "compiled" and _STATE["fn"] is None:
        _STATE["fn"] = _build()  # compiles now (seconds, once per process), not on a later call
    _STATE["name"] = name
    return name


def _build():
    """torch.compile the fused key pass and check it against the eager one on awkward values."""
    fn = torch.compile(bk._fused_keys, dynamic=False, fullgraph=True)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(bk._CHUNK, generator=g) * torch.exp2(
        torch.empty(bk._CHUNK).uniform_(-150, 128, generator=g))
    x[:6] = torch.tensor([0.0, -0.0, math.inf, math.nan, 65520.0, 2.0**-149])
    plan = bk._plan(tuple(get_format(f) for f in FORMATS if get_format(f).bits <= 32))
    splits = bk._split_table(plan, x.device)
    try:
        key, hi, lo = fn(x.view(torch.int32), *bk._split_slots(plan, x.device))
    except Exception as e:  # no C++ compiler, unsupported platform, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise RuntimeError(f"the compiled coverage kernel is not available here "
                           f"({type(e).__name__}: {first}); coverage stays 'eager'") from None
    with bk._buffers(bk._CHUNK, x.device) as bufs:
        ref_table, ref_hi, ref_lo = bk._count_chunks(x, bufs, splits)
    if not (torch.equal(torch.bincount(key, minlength=bk._KEYS), ref_table)
            and (int(hi), int(lo)) == (ref_hi, ref_lo)):
        raise RuntimeError("the compiled coverage kernel disagrees with the eager one here; "
                           "coverage stays 'eager'")
    return fn
