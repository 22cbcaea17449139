"""fp8_autocast for emulated layers: Fp8Linear layers made by a precision mode run FP8 only inside it."""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Any

import torch

from ampnb._interrupt import Guard

# Like Transformer Engine: its layers run FP8 inside te.fp8_autocast and in higher precision
# outside it, so a model converted for FP8 still computes exactly once the mode is left.
_ACTIVE: ContextVar[bool] = ContextVar("ampnb_fp8_autocast", default=False)


def fp8_active() -> bool:
    """Whether the caller is inside `fp8_autocast(enabled=True)`."""
    return _ACTIVE.get()


def fp8_autocast(enabled: bool = True) -> contextlib.AbstractContextManager:
    """Run context-following Fp8Linear layers in FP8 (True) or in plain precision (False)."""
    if not isinstance(enabled, bool):
        raise ValueError(f"enabled={enabled!r} is not allowed; allowed: True or False")
    return Guard(lambda: _ACTIVE.set(enabled), lambda token: _ACTIVE.reset(token))


def _set_default_dtype(dtype: torch.dtype) -> torch.dtype:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    return previous


def default_dtype_guard(dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """torch's default float dtype set for the body, restored even on an interrupt."""
    return Guard(lambda: _set_default_dtype(dtype), torch.set_default_dtype)


def autocast_guard(device_type: str, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """torch.autocast entered and exited as one interrupt-safe step."""
    autocast = torch.autocast(device_type, dtype=dtype)  # a bad device fails here, unchanged

    def enter() -> Any:
        autocast.__enter__()
        return autocast

    return Guard(enter, lambda ctx: ctx.__exit__(None, None, None))


def emulated_fp8_context(device_type: str, dtype: torch.dtype,
                         fallback: torch.dtype | None = None) -> contextlib.AbstractContextManager:
    """Lightning's FP8 forward stack: default dtype, fallback autocast, then FP8 autocast."""
    # A bad device fails here, unchanged; the fallback autocast runs in `fallback` (else dtype).
    autocast = torch.autocast(device_type, dtype=fallback or dtype)

    # One Guard for the three changes: an interrupt between them cannot leave one behind.
    def enter() -> tuple[torch.dtype, torch.autocast, Any]:
        previous = _set_default_dtype(dtype)
        autocast.__enter__()
        return previous, autocast, _ACTIVE.set(True)

    def exit(state: tuple[torch.dtype, torch.autocast, Any]) -> None:
        previous, ctx, token = state
        _ACTIVE.reset(token)
        ctx.__exit__(None, None, None)
        torch.set_default_dtype(previous)

    return Guard(enter, exit)
