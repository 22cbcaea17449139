"""What the Workbench needs around switches: module links, re-pointed optimizers, all-or-nothing
changes (the master copies themselves are `ampnb.start.Master`; a traceless probe is
`ampnb.putback.untouched`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ampnb._interrupt import Guard

_NARROW = (torch.float16, torch.bfloat16)


def module_links(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """Every (parent, name, child) link of the model, to undo conversions that swap submodules."""
    return [(parent, name, child) for parent in model.modules()
            for name, child in parent.named_children()]


def relink(links: list[tuple[nn.Module, str, nn.Module]]) -> None:
    """Put the recorded submodules back (e.g. nn.Linear where an FP8 swap put Fp8Linear)."""
    for parent, name, child in links:
        if getattr(parent, name, None) is not child:
            setattr(parent, name, child)


def repoint_optimizer(optimizer: torch.optim.Optimizer, before: list[nn.Parameter],
                      after: list[nn.Parameter], state: dict[str, Any]) -> None:
    """Point the optimizer's groups at the converted parameters, then load the cast state."""
    index = {id(p): i for i, p in enumerate(before)}
    if [id(p) for p in before] != [id(p) for p in after]:
        for group in optimizer.param_groups:
            group["params"] = [after[index[id(p)]] for p in group["params"]]
        optimizer.state.clear()
    optimizer.load_state_dict(state)


def all_or_nothing(change: Callable[[], tuple[Any, Any]], undo: Callable[[Any], None]) -> Any:
    """change() -> (checkpoint, result), run so an interrupt anywhere in it ends in undo; the result.

    change() must undo itself when it raises; an interrupt is held back while it runs and, if
    one came, undo((checkpoint, result)) runs before it is raised (ampnb._interrupt.Guard).
    """
    return Guard(change, undo).apply()[1]


def nonfinite_params(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
    """Names of the trained parameters holding inf/NaN: one fused amax check, names only if any."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    with torch.no_grad():
        amax = torch._foreach_norm(params, float("inf"))  # NaN and inf both survive a max
        if bool(torch.stack(amax).isfinite().all()):
            return ()
        return tuple(n for n, p in model.named_parameters() if not bool(p.isfinite().all()))
