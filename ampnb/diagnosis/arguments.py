"""The doctor's arguments checked before any work: each bad one named with what is allowed."""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

MAX_REPEAT = 100  # timed steps per mode: more says nothing new and can run for hours


def check_model(model: Any, optimizer: Any, repeat: int) -> None:
    if not isinstance(model, nn.Module):
        raise ValueError(f"doctor needs an nn.Module, got {type(model).__name__}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"{type(model).__name__} has no trainable parameters to train a step of")
    allowed = "allowed: an optimizer instance over the model's parameters, or None (AdamW)"
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        name = getattr(optimizer, "__name__", type(optimizer).__name__)
        raise ValueError(f"optimizer={name} is not allowed; {allowed}")
    if optimizer is not None:
        own = {id(p) for p in model.parameters()}
        if any(id(p) not in own for g in optimizer.param_groups for p in g["params"]):
            raise ValueError(f"optimizer={type(optimizer).__name__} holds parameters that are "
                             f"not the model's; {allowed}")
    if isinstance(repeat, bool) or not isinstance(repeat, int) or not 1 <= repeat <= MAX_REPEAT:
        raise ValueError(f"repeat={repeat!r} is not allowed; allowed: an integer from 1 to "
                         f"{MAX_REPEAT} (timed steps per mode)")


def check_options(loss_fn: Any, device: Any, modes: Any, seed: Any, progress: Any = None) -> None:
    """The doctor's other arguments: each named with what is allowed."""
    for name, value, ok, allowed in (
            ("loss_fn", loss_fn, loss_fn is None or callable(loss_fn),
             "a callable loss_fn(output, targets) such as nn.functional.mse_loss, or None (the "
             "model's own loss)"),
            ("device", device, device is None or (isinstance(device, (str, torch.device)) and
                                                  str(device).strip() != ""),
             "a device name such as 'cpu' or 'cuda:0', or None (the model's device)"),
            ("modes", modes, modes is None or isinstance(modes, str) or (
                isinstance(modes, Iterable) and not isinstance(modes, Mapping)),
             "mode names as 'a,b' or a list such as ['32-true', 'bf16-mixed'], or None (every "
             "mode)"),
            ("seed", seed, isinstance(seed, numbers.Integral) and not isinstance(seed, bool),
             "an integer"),
            ("progress", progress, progress is None or callable(progress),
             "a callable taking one line of text, or None (stderr after a second)")):
        if not ok:
            shown = repr(value) if len(repr(value)) <= 40 else f"a {type(value).__name__}"
            raise ValueError(f"{name}={shown} is not allowed; allowed: {allowed}")
