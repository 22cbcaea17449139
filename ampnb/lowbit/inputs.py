"""A model called on a user's inputs, and one line when torch rejects them (also the doctor's).

The user's own code failing gives the user's own exception; torch rejecting the inputs (a shape,
a dtype, an argument count) gives a ValueError from torch's error, naming what was passed.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from ampnb._tree import map_tensors
from ampnb.batch import as_batch
from ampnb.display import dtype_name

TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
ALLOWED = ("the model's own inputs, a tensor or tuple of positional inputs or a dict of keyword "
           "inputs (from an (inputs, targets) batch pass inputs=batch[0])")


def raised_in_torch(e: BaseException) -> bool:
    """Whether torch itself raised e (its innermost frame is torch's), not the model's own code."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename.startswith(TORCH_DIR)


def first_line(e: BaseException) -> str:
    """'RuntimeError: <the first line of its message>' (at most 200 characters of it)."""
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


class _Shape(str):
    __repr__ = str.__str__  # shown bare inside a container's repr


def shown(x: Any) -> str:
    """Tensors as dtype[shape] in the container's repr: '(float32[2, 64], int64[2])' (the type
    alone when that is not one short line)."""
    text = repr(map_tensors(lambda t: _Shape(f"{dtype_name(t.dtype)}{list(t.shape)}"), x))
    return text if len(text) <= 200 and "\n" not in text else f"a {type(x).__name__}"


def run_inputs(model: nn.Module, inputs: Any) -> Any:
    """model(*args, **kwargs) for inputs as a batch; ValueError from torch's error if it rejects them."""
    batch = as_batch(inputs)
    try:
        return batch.call(model)
    except (TypeError, RuntimeError, IndexError, ValueError) as e:
        if not raised_in_torch(e):
            raise  # the model's own code failed: its own exception
        raise ValueError(f"inputs={shown(inputs)} did not fit {type(model).__name__} "
                         f"({first_line(e)}); allowed: {ALLOWED}") from e
