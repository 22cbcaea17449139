"""NVIDIA APEX's opt levels (legacy), emulated with native torch: fp16 weights with fp32 masters.

APEX O2 keeps the model in fp16 (batch norm excepted) and gives the optimizer fp32 copies, the
master weights: after backward the fp16 gradients are copied to fp32, unscaled, the optimizer
steps the masters and the masters are rounded back into the fp16 model. Native AMP replaced
this by keeping the weights themselves in fp32 and casting per op under autocast.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from ampnb._checks import needs_module, shown
from ampnb._interrupt import Guard, deferred
from ampnb._weak import WeakIdMap
from ampnb.display import Table, TableView
from ampnb.formats import get_format

LEGACY = "legacy (APEX), emulated with native torch"
# APEX's dynamic loss scaler: start 2**16, x2 after 2000 clean steps, /2 on overflow — the
# defaults of torch.amp.GradScaler, which is used as is (APEX also capped the scale at 2**24).

# fp16 Parameter -> (its fp32 master, the fp16 value last written from that master).
_MASTERS = WeakIdMap()


def _cast_own(m: nn.Module, dtype: torch.dtype) -> None:
    # `.data =` keeps each Parameter object (and so the optimizer's hold on it), as nn.Module.to.
    for p in m._parameters.values():
        if p is not None and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
            if p.grad is not None:
                p.grad = p.grad.to(dtype)
    for name, b in m._buffers.items():
        if b is not None and b.is_floating_point():
            m._buffers[name] = b.to(dtype)


def is_batchnorm(m: nn.Module) -> bool:
    """A batch norm APEX keeps in fp32 (keep_batchnorm_fp32): an affine _BatchNorm."""
    return isinstance(m, nn.modules.batchnorm._BatchNorm) and m.affine


def half_except_batchnorm(module: nn.Module) -> nn.Module:
    """APEX O2's cast: every floating parameter and buffer to fp16 except batch norm's (in place)."""
    needs_module(module, "half_except_batchnorm")
    with deferred():  # all or none: an interrupt cannot leave half the model cast
        for m in module.modules():
            if not is_batchnorm(m):
                _cast_own(m, torch.float16)
        forget_masters(module)
    return module


def forget_masters(module: nn.Module) -> None:
    """Drop the masters of a module's parameters: the next step seeds them from the fp16 weights."""
    needs_module(module, "forget_masters")
    for p in module.parameters():
        _MASTERS.pop(p, None)


def _current(p: torch.Tensor) -> torch.Tensor | None:
    # A master is current while the fp16 weight still holds what was last written from it.
    found = _MASTERS.get(p)
    if found is not None and found[1].dtype == p.dtype and torch.equal(found[1], p.detach()):
        return found[0]
    return None


def master_of(t: torch.Tensor) -> torch.Tensor:
    """The fp32 master of an fp16 weight when it has a current one (APEX O2), else the tensor."""
    found = _current(t)
    return t if found is None else found


def _master_for(p: torch.Tensor) -> torch.Tensor:
    found = _current(p)
    if found is not None:
        return found
    # New, or the fp16 weight was changed from outside: seed from it, as APEX seeds its masters.
    master = p.detach().to(torch.float32, copy=True).requires_grad_(True)
    _MASTERS[p] = (master, p.detach().clone())
    return master


def _widen(state: dict[str, Any]) -> dict[str, Any]:
    # Optimizer state lives beside the fp32 masters in fp32 ('step' keeps its own dtype).
    return {k: v.float() if torch.is_tensor(v) and v.is_floating_point() and k != "step" else v
            for k, v in state.items()}


def swap_in(optimizer: torch.optim.Optimizer) -> list[tuple[dict, int, torch.Tensor, torch.Tensor]]:
    """Point the optimizer at fp32 masters of its fp16 parameters, with their grads in fp32."""
    swapped = []
    with deferred():
        for group in optimizer.param_groups:
            params = group["params"]
            for i, p in enumerate(params):
                if p.dtype != torch.float16:
                    continue  # fp32 parameters (batch norm) are their own masters, as in APEX
                m = _master_for(p)
                m.grad = None if p.grad is None else p.grad.detach().float()
                if p in optimizer.state:
                    optimizer.state[m] = _widen(optimizer.state.pop(p))
                params[i] = m
                swapped.append((group, i, p, m))
    return swapped


def swap_out(optimizer: torch.optim.Optimizer,
             swapped: list[tuple[dict, int, torch.Tensor, torch.Tensor]]) -> None:
    """Round the masters into the fp16 weights and point the optimizer back at them."""
    with deferred(), torch.no_grad():
        for group, i, p, m in swapped:
            p.copy_(m)  # round to nearest even, as APEX's master_params_to_model_params
            _MASTERS[p] = (m, p.detach().clone())
            if m in optimizer.state:
                optimizer.state[p] = optimizer.state.pop(m)
            group["params"][i] = p
            m.grad = None


def master_step(optimizer: torch.optim.Optimizer) -> Guard:
    """Around `scaler.step(optimizer)` / `optimizer.step()`: it steps the fp32 masters."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"master_step got {shown(optimizer)}; allowed: a torch.optim.Optimizer "
                         "instance")
    return Guard(lambda: swap_in(optimizer), lambda swapped: swap_out(optimizer, swapped))


def master_step_hooks() -> Guard:
    """Every `optimizer.step()` inside steps fp32 masters of its fp16 parameters (for %%amp cells)."""
    live: dict[int, tuple[torch.optim.Optimizer, list]] = {}

    def pre(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        with deferred():  # swapped and recorded together, so the exit can always swap back
            if id(opt) in live:  # an earlier step raised before its post hook
                swap_out(*live.pop(id(opt)))
            live[id(opt)] = (opt, swap_in(opt))

    def post(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        with deferred():
            if id(opt) in live:
                swap_out(*live[id(opt)])
                del live[id(opt)]

    def enter() -> tuple[Any, Any]:
        return register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)

    def leave(handles: tuple[Any, Any]) -> None:
        for handle in handles:
            handle.remove()
        while live:
            key = next(iter(live))
            swap_out(*live[key])
            del live[key]

    return Guard(enter, leave)


@dataclass(frozen=True, repr=False)
class LostUpdate(TableView):
    """One weight stepped by an update below half an fp16 ulp: which precisions keep it."""

    weight: float
    update: float
    steps: int
    rows: tuple[tuple[str, str, float], ...]  # (mode, what the optimizer steps, weight after)

    def kept(self, name: str) -> bool:
        """Whether the weight the model computes with moved."""
        return next(after for mode, _, after in self.rows if mode == name) != self.weight

    def table(self) -> Table:
        rows = [(mode, stepped, repr(after), "kept" if after != self.weight else "lost")
                for mode, stepped, after in self.rows]
        return Table(("mode", "optimizer steps", f"weight after {self.steps} steps", "update"), rows,
                     caption=f"w = {self.weight!r}, each step w -= {self.update!r} (1/4 of an fp16 "
                             "ulp at w)",
                     notes=("fp32 expects " + repr(self.weight - self.steps * self.update),))


def _stepped(weight: float, dtype: torch.dtype, lr: float, steps: int, masters: bool) -> float:
    p = nn.Parameter(torch.tensor([weight], dtype=dtype))
    opt = torch.optim.SGD([p], lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        p.sum().backward()  # gradient 1: each step subtracts lr
        with master_step(opt) if masters else contextlib.nullcontext():
            opt.step()
    return float(p.detach()[0])


def lost_update(weight: float = 1.5, steps: int = 8) -> LostUpdate:
    """The lost-update demonstration: pure fp16 (O3) loses the update, O2's fp32 master keeps it."""
    fp16 = get_format("fp16")
    w = float(weight)
    if not (fp16.smallest_normal <= abs(w) <= fp16.max) or float(torch.tensor(w).half()) != w:
        raise ValueError(f"weight={weight!r} is not allowed; allowed: a normal fp16 number "
                         "(such as 1.5), so that fp16 holds it exactly")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r} is not allowed; allowed: an integer >= 1")
    ulp = math.ldexp(1.0, math.frexp(abs(w))[1] - 1 - fp16.mantissa_bits)  # fp16's spacing at w
    update = ulp / 4  # below half an ulp: w - update rounds back to w in fp16
    rows = (
        ("apex-O3", "fp16 weights", _stepped(w, torch.float16, update, steps, False)),
        ("apex-O2", "fp32 masters -> fp16 weights", _stepped(w, torch.float16, update, steps, True)),
        ("16-mixed", "fp32 weights (autocast casts per op)", _stepped(w, torch.float32, update, steps,
                                                                     False)),
    )
    return LostUpdate(w, update, steps, rows)
