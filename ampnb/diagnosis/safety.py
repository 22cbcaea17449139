"""The doctor's safety net: torch's global state as it was, put back whatever happened."""

from __future__ import annotations

import torch

from ampnb._kernels import drop_overrides, live_overrides
from ampnb.device import restore_tf32, tf32_state


def save_state() -> tuple:
    return (torch.get_default_dtype(), tf32_state(), torch.is_grad_enabled(),
            len(_dispatch_stack()), live_overrides())


def restore_state(saved: tuple) -> None:
    """Safety net under the with-blocks: what an interrupt inside torch's own set-up could leave."""
    dtype, tf32, grad, depth, overrides = saved
    torch.set_default_dtype(dtype)
    restore_tf32(tf32)
    torch.set_grad_enabled(grad)
    drop_overrides(keep=overrides)  # kernel overrides never handed back (their modes, on old torch)
    while len(_dispatch_stack()) > depth:  # a dispatch mode pushed but never popped
        _pop_mode()


def _dispatch_stack() -> list:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return _get_current_dispatch_mode_stack()


def _pop_mode() -> None:
    from torch.utils._python_dispatch import _pop_mode

    _pop_mode()
