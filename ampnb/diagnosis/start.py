"""Where every run of the doctor starts: one snapshot of the model, its optimizer and the RNG.

The values are the Workbench's `Master` (parameters, buffers and optimizer state at fp32, APEX
masters included); the user's model and optimizer lend their structure only. Each run gets a
fresh model in its mode and the user's own optimizer (class, hyper-parameters, state) over it.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampnb._interrupt import Guard
from ampnb.modes import PrecisionMode
from ampnb.workbench.state import Master, named_tensors


def _cuda_live() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


@dataclass(frozen=True, eq=False)
class Rng:
    """torch's CPU generator and, once CUDA is up, every CUDA generator."""

    cpu: torch.Tensor
    cuda: list[torch.Tensor] | None

    @classmethod
    def take(cls) -> Rng:
        return cls(torch.get_rng_state(), torch.cuda.get_rng_state_all() if _cuda_live() else None)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


def seed(value: int, device: str) -> None:
    """Seed the generator the run draws from (CUDA's only when the run is on CUDA)."""
    torch.default_generator.manual_seed(value)
    if torch.device(device).type == "cuda":
        torch.cuda.manual_seed_all(value)


@dataclass(frozen=True, eq=False)
class Start:
    """The user's model and optimizer as they were (values in `master`), and the RNG."""

    model: nn.Module                     # structure only: never run, never changed
    optimizer: torch.optim.Optimizer     # the user's, or AdamW(lr=1e-3); never stepped
    master: Master
    rng: Rng

    @classmethod
    def take(cls, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Start:
        """Snapshot now; without an optimizer, AdamW(lr=1e-3) over the trainable parameters."""
        if optimizer is None:
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                          lr=1e-3)
        return cls(model, optimizer, Master.take(model, optimizer), Rng.take())

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

    def model_copy(self, mode: PrecisionMode, device: str) -> nn.Module:
        """A fresh model on device with the snapshot's values, converted by the mode."""
        return mode.convert_module(self._fresh(device)[0])

    def copy(self, mode: PrecisionMode, device: str) -> tuple[nn.Module, torch.optim.Optimizer]:
        """A fresh model in the mode and the user's optimizer over it, its state cast to the
        converted weights (as `load_state_dict` casts it)."""
        net, memo = self._fresh(device)
        memo[id(self.optimizer.state)] = defaultdict(dict)  # the state comes from the master
        opt = copy.deepcopy(self.optimizer, memo)
        net = mode.convert_module(net)
        opt.load_state_dict(self.master.optimizer_state())
        return net, opt


def started(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Guard:
    """`with started(model, opt) as start:` the snapshot; the RNG is put back on the way out."""
    return Guard(lambda: Start.take(model, optimizer), lambda start: start.rng.restore())
