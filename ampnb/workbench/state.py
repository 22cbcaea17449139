"""Master copies of model and optimizer state, all-or-nothing switches, traceless probes."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ampnb._interrupt import Guard
from ampnb.apex import is_batchnorm, master_of
from ampnb.display import dtype_name

_NARROW = (torch.float16, torch.bfloat16)


def _keep(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy that loses nothing: narrow floats widen to fp32, fp32/fp64 stay as they are."""
    t = t.detach()
    if t.is_floating_point() and t.dtype != torch.float64:
        return t.to("cpu", torch.float32, copy=True)
    return t.to("cpu", copy=True)


def named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and every buffer (non-persistent too), by name; tied weights once."""
    found = dict(model.named_parameters())
    found.update((n, b) for n, b in model.named_buffers() if b is not None)
    return found


@dataclass(frozen=True)
class Master:
    """Model tensors and optimizer state at fp32 (fp64 where they were fp64), kept on the CPU."""

    tensors: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    source_dtype: torch.dtype  # parameter dtype of the live model it was taken from
    wide: bool = field(default=False)  # some floating tensor is fp64
    params: frozenset[str] = frozenset()  # which tensors are parameters (the rest: buffers)

    @classmethod
    def take(cls, model: nn.Module, optimizer: torch.optim.Optimizer) -> Master:
        """Copy the live model and optimizer state."""
        live = named_tensors(model)
        tensors = {n: _keep(master_of(t)) for n, t in live.items()}  # APEX O2: the fp32 masters
        sd = optimizer.state_dict()
        state = {i: {k: _keep(v) if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                     for k, v in s.items()} for i, s in sd["state"].items()}
        opt = {"state": state, "param_groups": copy.deepcopy(sd["param_groups"])}
        wide = any(t.dtype == torch.float64 for t in tensors.values())
        params = frozenset(n for n, _ in model.named_parameters())
        source = param_dtype(model, mostly=True)
        if source in _NARROW and all(master_of(live[n]) is not live[n] for n in params
                                     if live[n].dtype == source):
            source = torch.float32  # every narrow weight had an fp32 master: nothing was lost
        return cls(tensors, opt, source, wide, params)

    def load_into(self, model: nn.Module) -> None:
        """Copy the master values into the model's tensors (casting to their dtype).

        Buffers only one side has (an FP8 layer's scaling history) are left as they are.
        """
        live = named_tensors(model)
        missing = sorted(self.params - set(live))
        if missing:
            raise ValueError(f"the model lost parameters {missing[:3]} while switching; allowed: "
                             f"a mode whose convert_module keeps parameter names.")
        with torch.no_grad():
            for name, value in self.tensors.items():
                if name in live:
                    live[name].copy_(value)

    def optimizer_state(self) -> dict[str, Any]:
        """A fresh copy for `optimizer.load_state_dict` (which casts it to each param's dtype)."""
        return copy.deepcopy(self.optimizer)


def param_dtype(model: nn.Module, mostly: bool = False) -> torch.dtype:
    """The dtype of the model's floating parameters (ValueError when they differ).

    Batch norm kept fp32 in an fp16 model (APEX O2) does not count. `mostly`: the dtype most
    parameter elements have (modules kept in fp32 inside a true mode, `keep_fp32`).
    """
    found = [p for p in model.parameters() if p.is_floating_point()]
    dtypes = {p.dtype for p in found}
    if len(dtypes) > 1:
        dtypes = {p.dtype for m in model.modules() if not is_batchnorm(m)
                  for p in m.parameters(recurse=False) if p.is_floating_point()}
    if mostly and len(dtypes) > 1:
        count = {d: sum(p.numel() for p in found if p.dtype == d) for d in dtypes}
        return max(count, key=count.get)
    if len(dtypes) != 1:
        names = sorted(dtype_name(d) for d in dtypes) or ["none"]
        raise ValueError(f"model has floating parameters in {', '.join(names)}; allowed: "
                         f"a model whose floating parameters share one dtype.")
    return dtypes.pop()


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
