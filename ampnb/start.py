"""Where a runner that must leave the user's objects untouched starts: one snapshot of the
model, its optimizer and the RNG (the doctor, memory_report, FP8's side_by_side).

The values are the Workbench's `Master` (parameters, buffers and optimizer state at fp32, APEX
masters included); the user's model and optimizer lend their structure only. Each run gets a
fresh model in its mode and the user's own optimizer (class, hyper-parameters, state) over it.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ampnb._interrupt import Guard
from ampnb.apex import is_batchnorm, master_of
from ampnb.display import dtype_name
from ampnb.modes import PrecisionMode
from ampnb.putback import Grads, Rng

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
    path: str | None = None  # where the values are, when they were put aside on disk

    def to_disk(self, path: str) -> Master:
        """The same master with its values in a file (read back for each copy), not in memory."""
        torch.save({"tensors": self.tensors, "optimizer": self.optimizer}, path)
        return dataclasses.replace(self, tensors={}, optimizer={}, path=path)

    def values(self) -> dict[str, torch.Tensor]:
        """The model tensors by name (read from disk, memory-mapped, when put aside there)."""
        return self._values()[0]

    def _values(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        if self.path is None:
            return self.tensors, self.optimizer
        found = torch.load(self.path, mmap=True, weights_only=True)  # our own file: data only
        return found["tensors"], found["optimizer"]

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
        tensors, _ = self._values()
        with torch.no_grad():
            for name, value in tensors.items():
                if name in live:
                    live[name].copy_(value)

    def optimizer_state(self) -> dict[str, Any]:
        """A fresh copy for `optimizer.load_state_dict` (which casts it to each param's dtype)."""
        return copy.deepcopy(self._values()[1])


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


def check_optimizer(model: nn.Module, optimizer: Any) -> None:
    """ValueError unless optimizer is a torch Optimizer over (some of) the model's parameters."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        shown = repr(optimizer) if len(repr(optimizer)) <= 40 else type(optimizer).__name__
        raise ValueError(f"optimizer={shown} is not allowed; allowed: a torch.optim.Optimizer "
                         "instance over the model's parameters, or None (AdamW, lr=1e-3)")
    own = {id(p) for p in model.parameters()}
    if any(id(p) not in own for g in optimizer.param_groups for p in g["params"]):
        raise ValueError(f"optimizer {type(optimizer).__name__} holds tensors that are not this "
                         "model's parameters; allowed: an optimizer built on model.parameters()")


@dataclass(frozen=True, eq=False)
class Start:
    """The user's model and optimizer as they were (values in `master`), and the RNG."""

    model: nn.Module                     # structure only: never run, never changed
    optimizer: torch.optim.Optimizer     # the user's, or AdamW(lr=1e-3); never stepped
    master: Master
    rng: Rng

    @classmethod
    def take(cls, model: nn.Module, optimizer: torch.optim.Optimizer | None,
             disk: str | None = None) -> Start:
        """Snapshot now; without an optimizer, AdamW(lr=1e-3) over the trainable parameters;
        with `disk` (a file path) the values wait there, not in memory.

        ValueError when the optimizer is not an Optimizer over the model's parameters."""
        if optimizer is not None:
            check_optimizer(model, optimizer)
        if optimizer is None:
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                          lr=1e-3)
        master = Master.take(model, optimizer)
        return cls(model, optimizer, master if disk is None else master.to_disk(disk), Rng.take())

    def _fresh(self, device: str) -> tuple[nn.Module, dict[int, Any]]:
        """A copy of the model's structure on device holding the snapshot's values, and the
        deepcopy memo that maps the user's tensors to the copy's."""
        memo: dict[int, Any] = {}
        for t in named_tensors(self.model).values():
            blank = torch.empty_like(t, device=device)
            memo[id(t)] = nn.Parameter(blank, t.requires_grad) if isinstance(
                t, nn.Parameter) else blank
        net = copy.deepcopy(self.model, memo)  # tied weights stay tied: one blank per tensor
        self.master.load_into(net)
        return net, memo

    def copy(self, mode: PrecisionMode, device: str) -> tuple[nn.Module, torch.optim.Optimizer]:
        """A fresh model in the mode and the user's optimizer over it, its state cast to the
        converted weights (as `load_state_dict` casts it)."""
        net, memo = self._fresh(device)
        memo[id(self.optimizer.state)] = defaultdict(dict)  # the state comes from the master
        opt = copy.deepcopy(self.optimizer, memo)
        net = mode.convert_module(net)
        opt.load_state_dict(self.master.optimizer_state())
        return net, opt


def started(model: nn.Module, optimizer: torch.optim.Optimizer | None,
            disk: str | None = None) -> Guard:
    """`with started(model, opt) as start:` the snapshot (its values in the file `disk` when
    given); the RNG is put back on the way out."""
    return Guard(lambda: Start.take(model, optimizer, disk), lambda start: start.rng.restore())


@dataclass(frozen=True, eq=False)
class Aside:
    """The user's gradients and optimizer state, put on disk while a runner works on copies (so
    the process holds one model's training memory, not two), and put back exactly after."""

    grads: Grads
    optimizer: torch.optim.Optimizer | None
    master: Master

    @classmethod
    def take(cls, start: Start, user_optimizer: torch.optim.Optimizer | None, path: str) -> Aside:
        """Save the gradients to `path`, then drop them and the optimizer's state (the snapshot
        already holds that state)."""
        found = cls(Grads.take(start.model, path), user_optimizer, start.master)
        if user_optimizer is not None:
            user_optimizer.state.clear()
        return found

    def restore(self) -> None:
        """Gradients and optimizer state as they were (the same values, new tensors)."""
        if self.optimizer is not None:
            self.optimizer.load_state_dict(self.master.optimizer_state())
        self.grads.restore()


def set_aside(start: Start, user_optimizer: torch.optim.Optimizer | None, path: str) -> Guard:
    """`with set_aside(start, optimizer, path):` the user's gradients and optimizer state on disk."""
    return Guard(lambda: Aside.take(start, user_optimizer, path), Aside.restore)
