"""Naming the module of a non-finite forward between statistics steps: its micro-batch, run again.

Between statistics steps the watch hooks no module (a forward hook on every module costs a few
percent of a small model's step); it keeps only references to the micro-batch's forward calls
and the RNG states before them. When a loss comes out non-finite, that forward runs again — the
same weights (the optimizer has not stepped yet), inputs, RNG states and autocast — with a
forward hook on every module, and stops at the first module, in the order modules finish, whose
output holds inf/NaN: what a statistics step's hooks would have named. The RNG states, buffers
(BatchNorm's running statistics) and modules' public attributes are put back after, so training
goes on as it would without the watch. A forward that depends on more than these (a counter kept
elsewhere, a global) may not overflow again: then no module is named.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ampnb._interrupt import critical
from ampnb.step import _AUTOCAST_DEVICES
from ampnb.watch import overflow
from ampnb.watch.hooks import Hook, float_outputs


class _Found(Exception):
    """Raised by the rerun's hook to stop the forward at the first non-finite output."""

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.index = index


def _stop_at_nonfinite(i: int, module: nn.Module, args: Any, out: Any) -> None:
    for t in float_outputs(out):
        if not bool(torch.isfinite(t).all()):
            raise _Found(i)


def autocast_as(autocast: Iterable[tuple[str, torch.dtype]]) -> contextlib.ExitStack:
    """Autocast on each device as a step's forward had it (off where it was off)."""
    wanted, stack = dict(autocast), contextlib.ExitStack()
    with stack:
        for device in _AUTOCAST_DEVICES:
            if device in wanted:
                stack.enter_context(torch.autocast(device, dtype=wanted[device]))
            elif torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        return stack.pop_all()


@critical  # its restore must run whole: an interrupt is held until it is done
def first_nonfinite_module(model: nn.Module, modules: list[nn.Module],
                           calls: list[tuple[nn.Module, tuple, dict, list]],
                           rng: dict[str, Any] | None) -> int | None:
    """Index (in `modules`) of the first module whose output holds inf/NaN when the forward
    `calls` (module, args, kwargs, the autocast on at the call) run again from the RNG states
    `rng`; None when none does."""
    now = overflow.rng_states()
    buffers = [(b, b.clone()) for b in model.buffers()]
    attrs = [(m, {k: v for k, v in vars(m).items() if not k.startswith("_")}) for m in modules]
    handles: list[Any] = []
    try:
        for i, m in enumerate(modules):
            handles.append(m.register_forward_hook(Hook(_stop_at_nonfinite, i)))
        if rng is not None:
            overflow.set_rng_states(rng)
        with torch.enable_grad():
            for module, args, kwargs, autocast in calls:
                with autocast_as(autocast):
                    module(*args, **kwargs)
    except _Found as found:
        return found.index
    except Exception:  # noqa: BLE001 - the rerun only names a module; it must not break the loop
        return None
    finally:
        for h in handles:
            h.remove()
        overflow.set_rng_states(now)
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for m, saved_attrs in attrs:
            for k in [k for k in vars(m) if not k.startswith("_") and k not in saved_attrs]:
                delattr(m, k)
            vars(m).update(saved_attrs)
    return None
