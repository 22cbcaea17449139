"""What `ampnb.watch` accepts: the model, optimizer and scaler behind the wrappers users have."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampnb.start import check_optimizer


def _shown(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 40 and "\n" not in text else type(x).__name__


def unwrap_model(model: Any) -> nn.Module:
    """The module whose submodules run: DDP's `.module`; a torch.compile'd model is refused."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model={_shown(model)} is not allowed; allowed: an nn.Module with "
                         "parameters")
    for name, m in model.named_modules():
        # hooks are traced into a compiled graph (inductor then fuses the step differently from
        # the unwatched compiled run) and compiled blocks are named with `_orig_mod`: refused
        if (type(m).__name__ == "OptimizedModule" and hasattr(m, "_orig_mod")
                or getattr(m, "_compiled_call_impl", None) is not None):
            what = f"its block {name!r}" if name else "model"
            raise ValueError(f"{what} is compiled (torch.compile or .compile()), which "
                             "ampnb.watch does not support; allowed: the model without "
                             "torch.compile")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module  # names without the 'module.' prefix
    if next(model.parameters(), None) is None:
        raise ValueError(f"model {type(model).__name__} has no parameters; allowed: an nn.Module "
                         "with parameters")
    return model


def unwrap_optimizer(model: nn.Module, optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside Lightning's (`._optimizer`) or Accelerate's (`.optimizer`)."""
    for _ in range(4):  # wrappers of wrappers, a few deep at most
        if type(optimizer).__name__ == "LightningOptimizer" and hasattr(optimizer, "_optimizer"):
            optimizer = optimizer._optimizer
        elif type(optimizer).__name__ == "AcceleratedOptimizer" and hasattr(optimizer,
                                                                            "optimizer"):
            optimizer = optimizer.optimizer
        else:
            break
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer={_shown(optimizer)} is not allowed; allowed: a "
                         "torch.optim.Optimizer over the model's parameters (or Lightning's or "
                         "Accelerate's wrapper of one)")
    check_optimizer(model, optimizer)
    return optimizer


def check_scaler(scaler: Any) -> torch.amp.GradScaler | None:
    """A GradScaler that is enabled, or None (a disabled one never skips nor scales)."""
    if scaler is None:
        return None
    if not isinstance(scaler, torch.amp.GradScaler):  # torch.cuda.amp.GradScaler subclasses it
        raise ValueError(f"scaler={_shown(scaler)} is not allowed; allowed: None or a "
                         "torch.amp.GradScaler")
    return scaler if scaler.is_enabled() else None


def check_every(every: Any) -> int:
    """A positive int (bool and float refused)."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"every={every!r} is not allowed; allowed: a positive int (statistics "
                         "every that many optimizer steps)")
    return every


def check_path(name: str, path: Any) -> str | os.PathLike | None:
    """None, a str or an os.PathLike."""
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"{name}={_shown(path)} is not allowed; allowed: None, a str or a "
                         "path")
    return path


def real(path: str | os.PathLike) -> Path:
    """The folder or file a path names, as the system resolves it: links followed, '..' taken
    lexically past the folders that do not exist yet ('new/../a' is 'a', and 'new' is not made)."""
    return Path(os.path.realpath(path))


def _creatable(folder: Path) -> str | None:
    """Why files cannot be written in `folder` (None: they can); what it makes it takes away."""
    made, p = [], real(folder)
    while not p.exists() and p != p.parent:
        made.append(p)
        p = p.parent
    try:
        for d in reversed(made):
            d.mkdir()
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        return e.strerror or type(e).__name__
    finally:
        for d in made:
            with contextlib.suppress(OSError):
                d.rmdir()
    return None


def check_keep_overflow(path: Any) -> Path | None:
    """None, or the path (resolved, see `real`) where the overflowing step's file can be
    written (tried now)."""
    from ampnb.watcher.overflow import target

    path = check_path("keep_overflow", path)
    if path is None:
        return None
    file = target(real(path))
    why = "it is a folder" if file.is_dir() else _creatable(file.parent)
    if why is not None:
        raise ValueError(f"keep_overflow={os.fspath(path)!r} cannot be written ({file}: {why}); "
                         "allowed: a path in a writable folder")
    return real(path)


def check_log_dir(log_dir: Any, rank: int | None) -> Path | None:
    """None, or the folder (resolved, see `real`) to write in, holding no other run's records
    (runs never merge; `owner.claim` keeps a second watch out while this one is open)."""
    from ampnb.watcher.owner import holds_a_run
    from ampnb.watchlog.records import log_path

    log_dir = check_path("log_dir", log_dir)
    if log_dir is None:
        return None
    shown, folder = repr(os.fspath(log_dir)), real(log_dir)
    file = log_path(folder, rank)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"log_dir={shown} is a file; allowed: a folder (new or empty)")
    if file.exists():
        raise holds_a_run(shown, file)
    why = _creatable(file.parent)
    if why is not None:
        raise ValueError(f"log_dir={shown} cannot be written ({why}); allowed: a folder in a "
                         "writable place")
    return folder
