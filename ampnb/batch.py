"""The one notion of "a batch" and of "the loss of a step", shared by every ampnb runner.

A batch is positional inputs (a tensor or a tuple of them), a keyword dict (what a Hugging Face
tokenizer returns), or `(inputs, targets)` when a `loss_fn` is given. Without a `loss_fn` the
model's own loss is used: a `ModelOutput.loss`, a `"loss"` entry, or a scalar output.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ampnb._tree import map_tensors
from ampnb.display import dtype_name

ALLOWED = ("a tensor or tuple of positional inputs, a dict of keyword inputs, "
           "or (inputs, targets) with a loss_fn")


@dataclass(frozen=True)
class Batch:
    """What the model is called with, and the targets its loss_fn gets (None: none)."""

    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    targets: Any = None

    def to(self, device: str | torch.device) -> Batch:
        """The batch on a device (tensors moved, containers kept)."""
        move = lambda t: t.to(device)  # noqa: E731
        return Batch(map_tensors(move, self.args), map_tensors(move, dict(self.kwargs)),
                     map_tensors(move, self.targets))

    def convert(self, fn: Callable[[Any], Any]) -> Batch:
        """Inputs passed through fn (a mode's convert_input); targets as they are."""
        return Batch(tuple(fn(a) for a in self.args), {k: fn(v) for k, v in self.kwargs.items()},
                     self.targets)

    def call(self, model: Callable[..., Any]) -> Any:
        """model(*args, **kwargs)."""
        return model(*self.args, **self.kwargs)


def _inputs(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)) and not hasattr(inputs, "_fields"):
        return tuple(inputs), {}
    return (inputs,), {}


def as_batch(batch: Any, loss_fn: Callable[..., Any] | None = None) -> Batch:
    """A user's batch as a Batch: with a loss_fn a pair is (inputs, targets); else all inputs."""
    if isinstance(batch, Batch):
        return batch
    if batch is None or isinstance(batch, (str, bytes)):
        raise ValueError(f"batch={batch!r} is not allowed; allowed: {ALLOWED}.")
    if loss_fn is not None:
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise ValueError(f"with a loss_fn, a batch is (inputs, targets); got "
                             f"{type(batch).__name__}{_length(batch)}; allowed: {ALLOWED}.")
        args, kwargs = _inputs(batch[0])
        return Batch(args, kwargs, batch[1])
    args, kwargs = _inputs(batch)
    return Batch(args, kwargs)


def _length(x: Any) -> str:
    return f" of length {len(x)}" if hasattr(x, "__len__") else ""


def model_loss(output: Any) -> torch.Tensor | None:
    """The loss a model returned itself (ModelOutput.loss, a 'loss' entry, a scalar), or None."""
    if isinstance(output, torch.Tensor):
        return output if output.numel() == 1 and output.is_floating_point() else None
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


def step_loss(output: Any, batch: Batch, loss_fn: Callable[..., Any] | None) -> torch.Tensor:
    """loss_fn(output, targets), or the model's own loss (ValueError naming what is allowed)."""
    if loss_fn is not None:
        return loss_fn(output, batch.targets)
    loss = model_loss(output)
    if loss is None:
        raise ValueError(f"the model returned {type(output).__name__} without a loss; allowed: "
                         "pass loss_fn=, or a model that returns a scalar or an output with "
                         ".loss (e.g. a transformers model given labels=).")
    return loss


# ----- when torch rejects what it was given --------------------------------------------------

TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
def raised_in_torch(e: BaseException) -> bool:
    """Whether torch itself raised e (its innermost frame is torch's), not the model's own code."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename.startswith(TORCH_DIR)


def first_line(e: BaseException, limit: int = 200) -> str:
    """'RuntimeError: <the first line of its message>', at most `limit` characters."""
    first = (str(e).strip().splitlines() or [""])[0]
    text = f"{type(e).__name__}: {first}" if first else type(e).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


_AMPNB_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def raised_at(e: BaseException) -> str:
    """Where the user's code raised e: 'forward, model.py:12' (its innermost frame outside
    torch and ampnb), or '' when none is."""
    tb, found = e.__traceback__, ""
    while tb is not None:
        code = tb.tb_frame.f_code
        if not code.co_filename.startswith((TORCH_DIR, _AMPNB_DIR)):
            found = f"{code.co_name}, {os.path.basename(code.co_filename)}:{tb.tb_lineno}"
        tb = tb.tb_next
    return found


def failure(e: BaseException, limit: int = 200) -> str:
    """first_line(e), then where the user's code raised it: 'RuntimeError: ... (at forward,
    model.py:12)'; the message is shortened first, so the place always shows."""
    at = raised_at(e)
    suffix = f" (at {at})" if at else ""
    return first_line(e, max(40, limit - len(suffix))) + suffix


class _Shape(str):
    __repr__ = str.__str__  # shown bare inside a container's repr


def shown(x: Any) -> str:
    """Tensors as dtype[shape] in the container's repr: '(float32[2, 64], int64[2])' (the type
    alone when that is not one short line)."""
    text = repr(map_tensors(lambda t: _Shape(f"{dtype_name(t.dtype)}{list(t.shape)}"), x))
    return text if len(text) <= 200 and "\n" not in text else f"a {type(x).__name__}"
