"""keep_overflow: what the watch saves of the first overflowing step, so replay can rerun it.

One file written with torch.save, data only: it loads with `torch.load(weights_only=True)`
(tensors, dicts, lists, tuples, numbers, strings, bytes), checked right after it is written. It
holds the step's micro-batches (the forward inputs of the model, or of the child of it that the
loop called, named in "entries"; containers made plain: a namedtuple a tuple, a dataclass,
ModelOutput or other Mapping a dict), the gradient the user's own loss sent into each
micro-batch's outputs (so the replay's backward is the user's, loss scale included), the RNG
states at its first forward, the autocast that was on, the model's state_dict, the optimizer's
state_dict and the scaler's state, all as they were before the step's update, and the model
pickled (bytes, when it can be), which replay unpickles only with `trust_pickled_model=True`.
"""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampnb._tree import plain

FILE_NAME = "overflow.pt"
FORMAT = 4


def target(path: str | os.PathLike) -> Path:
    """The file: `path` itself when it names a file (a suffix), else path/overflow.pt."""
    p = Path(path)
    return p / FILE_NAME if p.is_dir() or not p.suffix else p


def autocast_as(autocast: list[tuple[str, torch.dtype]] | tuple) -> contextlib.ExitStack:
    """Autocast on each device as a step's forward had it (off where it was off)."""
    from ampnb.step import _AUTOCAST_DEVICES

    wanted, stack = dict(autocast), contextlib.ExitStack()
    with stack:
        for device in _AUTOCAST_DEVICES:
            if device in wanted:
                stack.enter_context(torch.autocast(device, dtype=wanted[device]))
            elif torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        return stack.pop_all()


def _pickled(model: nn.Module) -> bytes | None:
    """The module as torch.save writes it, or None when it cannot be pickled (a local class)."""
    buf = io.BytesIO()
    try:
        torch.save(model, buf)
    except Exception:  # noqa: BLE001 - any pickling failure: replay then needs model=
        return None
    return buf.getvalue()


def save(path: str | os.PathLike, *, step: int, inputs: list, entries: list[str],
         out_grads: list, rng: dict[str, Any] | None,
         autocast: list[tuple[str, torch.dtype]], model: nn.Module,
         optimizer: torch.optim.Optimizer, scaler: dict[str, Any] | None,
         scale: float | None, loss: float) -> Path:
    """Write the step to `path` (see the module docstring); returns the file written."""
    file = target(path)
    file.parent.mkdir(parents=True, exist_ok=True)  # checked writable when the watch started
    torch.save({
        "format": FORMAT,
        "step": step,
        "inputs": plain(inputs),
        "entries": entries,  # the module each forward entered ("": the model itself)
        "out_grads": out_grads,  # per micro-batch, per floating output: its gradient (or None)
        "rng": rng,
        "autocast": [(d, str(dt).removeprefix("torch.")) for d, dt in autocast],
        "model": _pickled(model),
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "training": model.training,
        "state_dict": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "optimizer_class": type(optimizer).__name__,
        "scaler": scaler,
        "scale": scale,
        "loss": loss,
    }, file)
    _check_data(file)
    return file


def _check_data(file: Path) -> None:
    """The file loads with weights_only=True (memory-mapped: the tensors are not read), or it is
    removed and a ValueError says what in it is not data (an input of the user's own type, a
    tensor subclass in the state_dict)."""
    try:
        torch.load(file, mmap=True, weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch's UnpicklingError, or what the global was
        file.unlink()
        raise ValueError(f"it would hold more than data ({unpickling_error(e)})") from None


def unpickling_error(e: BaseException) -> str:
    """torch's reason why weights_only refused a file, on one line."""
    text = str(e)
    rest = text.partition("WeightsUnpickler error:")[2].strip() or text.strip()
    line = rest.splitlines()[0] if rest else type(e).__name__
    return line.split(" was not an allowed")[0]


def keep(path: str | os.PathLike, s: Any, model: nn.Module, optimizer: torch.optim.Optimizer,
         step: int) -> Path | None:
    """Save the StepState `s` (see save); a failure is a warning (None), never an error in the
    user's training."""
    try:
        return save(path, step=step, inputs=s.inputs, rng=s.rng and s.rng.as_dict(), entries=s.entries,
                    out_grads=s.out_grads, autocast=s.autocast, model=model, optimizer=optimizer,
                    scaler=s.scaler_state, scale=s.scale, loss=s.loss())
    except Exception as e:  # noqa: BLE001 - the user's training must go on
        warnings.warn(f"ampnb.watch could not save the overflowing step to {target(path)}: {e}",
                      stacklevel=4)
        return None
