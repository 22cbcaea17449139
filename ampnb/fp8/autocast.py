"""fp8_autocast for emulated layers: Fp8Linear layers made by a mode run FP8 only inside it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch

# Like Transformer Engine: its layers run FP8 inside te.fp8_autocast and in higher precision
# outside it, so a model converted for FP8 still computes exactly once the mode is left.
_ACTIVE: ContextVar[bool] = ContextVar("ampnb_fp8_autocast", default=False)


def fp8_active() -> bool:
    """Whether the caller is inside `fp8_autocast(enabled=True)`."""
    return _ACTIVE.get()


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True) -> Iterator[None]:
    """Run context-following Fp8Linear layers in FP8 (True) or in plain precision (False)."""
    if not isinstance(enabled, bool):
        raise ValueError(f"enabled={enabled!r} is not allowed; allowed: True or False")
    token = _ACTIVE.set(enabled)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def emulated_fp8_context(device_type: str, dtype: torch.dtype) -> Iterator[None]:
    """Lightning's FP8 forward stack: default dtype, fallback autocast, then FP8 autocast."""
    from ampnb.modes import default_dtype

    with default_dtype(dtype), torch.autocast(device_type, dtype=dtype), fp8_autocast(True):
        yield
