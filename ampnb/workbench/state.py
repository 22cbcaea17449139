"""What the Workbench needs around switches: module links, re-pointed optimizers, all-or-nothing
changes, traceless probes (the master copies themselves are `ampnb.start.Master`)."""

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


def _leave(model: nn.Module) -> tuple[Any, ...]:
    """Save what a probe's forward and backward change, and clear the grads for it."""
    buffers = {n: b.detach().clone() for n, b in model.named_buffers() if b is not None}
    grads = [(p, p.grad) for p in model.parameters()]
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    rng = (torch.get_rng_state(), torch.cuda.get_rng_state_all() if cuda else None)
    for p, _ in grads:
        p.grad = None  # the probe's backward must not add into the last step's gradients
    return model, buffers, grads, rng


def _put_back(saved: tuple[Any, ...]) -> None:
    model, buffers, grads, (cpu_rng, cuda_rng) = saved
    live = dict(model.named_buffers())
    with torch.no_grad():
        for name, value in buffers.items():
            live[name].copy_(value)
    for p, g in grads:
        p.grad = g
    torch.set_rng_state(cpu_rng)
    if cuda_rng is not None:
        torch.cuda.set_rng_state_all(cuda_rng)


def untouched(model: nn.Module) -> Guard:
    """`with untouched(model):` a probe without a trace: RNG streams, buffers (BatchNorm stats)
    and grads are put back, also when it raises or is interrupted."""
    return Guard(lambda: _leave(model), _put_back)
