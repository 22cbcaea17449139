"""A model called on a user's inputs, and one line when torch rejects them (also the doctor's).

The user's own code failing gives the user's own exception; torch rejecting the inputs (a shape,
a dtype, an argument count) gives a ValueError from torch's error, naming what was passed.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ampnb.batch import as_batch, first_line, raised_in_torch, shown

ALLOWED = ("the model's own inputs, a tensor or tuple of positional inputs or a dict of keyword "
           "inputs (from an (inputs, targets) batch pass inputs=batch[0])")



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
