"""When torch rejects the batch, the loss or its backward in the doctor's reference step: torch's
own error stays (as the cause), with one line saying what the doctor expected."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any

import torch

from ampnb.batch import ALLOWED, TORCH_DIR, Batch, first_line, raised_in_torch, shown

_BATCH = os.path.join("ampnb", "batch.py")
_FORWARD = ("the model could not run the batch", "inputs the model accepts: " + ALLOWED
            + " (token ids as integer tensors)")
_LOSS = ("loss_fn could not take the model's output and the targets",
         "a loss_fn(output, targets) that returns a floating-point scalar")
_BACKWARD = ("the loss could not be backpropagated", "a floating-point scalar loss computed from "
             "the model's parameters (reduce it to one number, e.g. .mean(); an integer output "
             "such as argmax has no gradient)")


def _frames(tb: TracebackType | None) -> list[Any]:
    found = []
    while tb is not None:
        found.append(tb.tb_frame)
        tb = tb.tb_next
    return found


def _backward(frames: list[Any]) -> Any:
    """The tensor `.backward()` was called on, or True for another autograd entry, else None."""
    for f in frames:
        name, code = f.f_code.co_filename, f.f_code.co_name
        if name.startswith(TORCH_DIR) and code == "backward":
            loss = f.f_locals.get("self")
            return loss if isinstance(loss, torch.Tensor) else True
    return None


def _explained(e: BaseException, batch: Batch, model: str, cell: bool) -> str | None:
    """The one line for a torch error in the step, or None (the user's own code raised it)."""
    frames = _frames(e.__traceback__)
    if not raised_in_torch(e):
        return None  # raised by the user's own code (or ampnb's, already one line): as it is
    loss = _backward(frames)
    if loss is not None:
        what, allowed = _BACKWARD
        called = "" if loss is True else (
            f"; the loss was {shown(loss)}" + ("" if loss.requires_grad else " without a gradient"))
        return f"{what} ({first_line(e)}){called}; allowed: {allowed}"
    at = [f for f in frames if f.f_code.co_filename.endswith(_BATCH)]
    if cell or not at:
        return None  # a cell's own code (%%amp --doctor): the user's exception as it is
    if at[-1].f_code.co_name == "step_loss":
        output = at[-1].f_locals.get("output")
        what, allowed = _LOSS
        called = f"loss_fn({shown(output)}, {shown(batch.targets)})"
    else:
        what, allowed = _FORWARD
        args = [shown(a) for a in batch.args] + [f"{k}={shown(v)}" for k, v in batch.kwargs.items()]
        called = f"{model}({', '.join(args)})"
    return f"{what} ({first_line(e)}); the doctor called {called}; allowed: {allowed}"


@contextmanager
def expected(batch: Batch, model: str, cell: bool = False) -> Iterator[None]:
    """Around the reference step: a torch error about the batch, the loss or its backward
    becomes a ValueError from it, naming what was passed and what is allowed (for a cell's
    step, `cell`, only the backward the doctor runs itself: the rest is the user's code)."""
    try:
        yield
    except (RuntimeError, TypeError, IndexError, ValueError) as e:
        line = _explained(e, batch, model, cell)
        if line is None:
            raise
        raise ValueError(line) from e
