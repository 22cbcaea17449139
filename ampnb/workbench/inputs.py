"""What a Workbench is given, checked before anything changes; what its model's forward gave."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ampnb._tree import tensors
from ampnb.batch import ALLOWED, Batch, as_batch, model_loss


def output_dtype(raw: Any) -> torch.dtype | None:
    """The dtype of the model's first floating output that is not its own loss."""
    loss = model_loss(raw)
    floats = [t for t in tensors(raw) if t.is_floating_point()]
    found = next((t for t in floats if t is not loss), loss)
    return None if found is None else found.dtype


def check_inputs(model: Any, optimizer: Any, loss_fn: Any,
                  batches: Any) -> tuple[list[Any], list[Batch]]:
    """The user's batches as a list, and as Batches (ValueError naming what is allowed)."""
    if not isinstance(model, nn.Module) or next(iter(model.parameters()), None) is None:
        raise ValueError(f"model={type(model).__name__} is not allowed; allowed: a torch.nn.Module "
                         f"with parameters.")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer={type(optimizer).__name__} is not allowed; allowed: a "
                         f"torch.optim.Optimizer built on model.parameters().")
    own = {id(p) for p in model.parameters()}
    held = [p for g in optimizer.param_groups for p in g["params"]]
    if not held or any(id(p) not in own for p in held):
        raise ValueError(f"optimizer {type(optimizer).__name__} holds parameters that are not the "
                         f"model's; allowed: an optimizer built on model.parameters().")
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(f"loss_fn={loss_fn!r} is not allowed; allowed: a callable (outputs, "
                         f"targets), or None for the model's own loss.")
    if isinstance(batches, (str, bytes, Batch)) or not isinstance(batches, Iterable):
        raise ValueError(f"batches={batches!r:.60} is not allowed; allowed: a non-empty list of "
                         f"batches, each {ALLOWED}.")
    given = batches if isinstance(batches, list) else list(batches)
    if not given:
        raise ValueError(f"batches is empty; allowed: a non-empty list of batches, each {ALLOWED}.")
    return given, [as_batch(b, loss_fn) for b in given]
