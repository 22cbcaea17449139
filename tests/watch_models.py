"""A planted overflow and the plain torch.amp loop the watch tests run with and without a watch."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

import ampnb


class Spike(nn.Linear):
    """A Linear whose output is multiplied past fp16's max on one training step only."""

    def __init__(self, at: int | None) -> None:
        super().__init__(16, 16)
        self.at, self.calls = at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.training and torch.is_grad_enabled():
            self.calls += 1
            if self.calls - 1 == self.at:
                out = out * (4 * torch.finfo(torch.float16).max)  # |out| ~ 1: inf in fp16
        return out


class Blowup(nn.Module):
    """Multiplies by 1e5 when told to: past fp16's max under fp16 autocast."""

    def forward(self, x: torch.Tensor, blow: bool = False) -> torch.Tensor:
        return x * 1e5 if blow else x


class Planted(nn.Module):
    """Linear -> Blowup -> ReLU -> Linear; `blow=True` in a batch's kwargs plants the overflow."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = nn.Linear(8, 16)
        self.blowup = Blowup()
        self.act = nn.ReLU()
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, blow: bool = False) -> torch.Tensor:
        return self.fc2(self.drop(self.act(self.blowup(self.fc1(x), blow))))


def batches(n: int, blow_at: int | None = None, micro: int = 1, seed: int = 1) -> list:
    """n steps of `micro` micro-batches each: (x, y, blow); blow on step blow_at's first one."""
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g),
              k == blow_at and j == 0) for j in range(micro)] for k in range(n)]


def run(model: nn.Module, opt: torch.optim.Optimizer, steps: list, *, dtype=torch.float16,
        scaler: torch.amp.GradScaler | None = None, watch: dict | None = None,
        seed: int = 0) -> ampnb.watcher.Watch | None:
    """The canonical torch.amp loop (nanoGPT's order), with a watch attached when asked."""
    torch.manual_seed(seed)
    w = ampnb.watch(model, opt, scaler, **watch) if watch is not None else None
    with w if w is not None else contextlib.nullcontext():
        for micro in steps:
            for x, y, blow in micro:
                with torch.autocast("cpu", dtype=dtype):
                    out = model(x, blow=blow) if blow else model(x)
                    loss = nn.functional.mse_loss(out.float(), y) / len(micro)
                (scaler.scale(loss) if scaler is not None else loss).backward()
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
    return w
