"""Planted cases for the doctor: models that break in a known place, in a known way."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class ForwardOverflow(nn.Module):
    """`up` outputs ~1e5 (past fp16's 65504); the LayerNorm after it brings values back."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 32)
        self.up = nn.Linear(32, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 4)
        with torch.no_grad():
            self.up.weight.mul_(3e5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.up(torch.relu(self.inp(x)))))


class BackwardOverflow(nn.Module):
    """Tiny activations into `b`, whose huge weights send gradients past 65504 in backward only."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        with torch.no_grad():
            self.a.weight.mul_(1e-4)
            self.a.bias.zero_()
            self.b.weight.mul_(1e5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


class Cancel(nn.Module):
    """(x + 256) - 256: exact in fp32, catastrophic cancellation in bf16 (spacing 2 at 256)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + 256.0) - 256.0


class Sensitive(nn.Module):
    """A Linear, then a layer that cancels catastrophically in bf16, then a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(16, 16)
        self.cancel = Cancel()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.cancel(self.lin(x))))


class Plain(nn.Module):
    """A small MLP every mode handles."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def data(n: int = 8, features: int = 16, classes: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, features, generator=g), torch.randint(0, classes, (n,), generator=g)


def sum_loss(out: torch.Tensor, targets: object) -> torch.Tensor:
    return out.float().sum()


class Embedded(nn.Module):
    """An embedding and a head: rows of the embedding the batch does not use get zero gradients."""

    def __init__(self, vocab: int = 64, hidden: int = 16, classes: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).mean(1))


def token_data(n: int = 8, seq: int = 6, vocab: int = 16, classes: int = 4
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids from the first `vocab` rows only, and class targets."""
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, vocab, (n, seq), generator=g), torch.randint(0, classes, (n,), generator=g)


class DtypeDrawn(nn.Module):
    """Dropout whose draws depend on the dtype it runs in (as CUDA's attention kernels' do): one
    random number per 16 bytes of its input, so fp32 and bf16 inputs get different masks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        per = 16 // x.element_size()
        r = torch.rand(x.numel() // per + 1, device=x.device)
        keep = r.repeat_interleave(per)[: x.numel()].view_as(x) >= 0.5
        return x * keep * 2


class DrawsByDtype(nn.Module):
    """A Linear, the dtype-dependent dropout, a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 64)
        self.drop = DtypeDrawn()
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.inp(x)))


class NumpyMasked(ForwardOverflow):
    """ForwardOverflow whose forward zeroes 4 input features drawn from numpy's global RNG in
    training, as wav2vec2's SpecAugment draws its masks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            import numpy as np

            cols = torch.as_tensor(np.random.choice(x.shape[1], 4, replace=False))
            x = x.index_fill(1, cols, 0.0)
        return super().forward(x)


class Dense(nn.Module):
    """Five branches whose outputs (~1e5) overflow fp16, summed and scaled back to ~1."""

    def __init__(self) -> None:
        super().__init__()
        self.branches = nn.ModuleList(nn.Linear(16, 16) for _ in range(5))
        with torch.no_grad():
            for b in self.branches:
                b.weight.mul_(3e5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(b(x) for b in self.branches) / 1e6


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = Dense()
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.dense(x))


class ManyLeaves(nn.Module):
    """Two blocks whose `dense` each hold five overflowing Linear leaves: ten sites, over the
    island cap, that their two `dense` parents group (T5's DenseReluDense)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class SlowInFp16(nn.Module):
    """Plain, with a layer that takes 0.5 s per sample when it runs in fp16 (a CPU's slow fp16
    kernels, injected): the doctor must measure the cost, not assume it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if h.dtype == torch.float16:
            import time

            time.sleep(0.5 * h.shape[0])
        return self.head(torch.relu(h))


class SlowStep(nn.Module):
    """Plain whose every forward takes 0.2 s: a step long enough to count in a tiny budget."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import time

        time.sleep(0.2)
        return self.net(x)


class Fp32Embedding(nn.Module):
    """A timestep embedding built in fp32 inside forward (as a diffusion UNet's): it meets the
    weights' dtype in a matmul, which fails when the weights are bf16 (bf16-true)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = torch.arange(16, dtype=torch.float32).expand(x.shape[0], 16)
        return nn.functional.linear(x + t, self.lin.weight, self.lin.bias)


# CPU classes by their /proc/cpuinfo flags, injected with `cpu_features_as` (speed is not tested
# by injection: a class's slowness is planted in the model instead, as in SleepyOverflow).
CPU_CLASSES = {
    "avx2": frozenset({"avx", "avx2", "fma", "f16c"}),
    "avx512-bf16": frozenset({"avx", "avx2", "fma", "f16c", "avx512f", "avx512_bf16"}),
    "amx-fp16": frozenset({"avx", "avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16",
                           "amx_bf16", "amx_fp16"}),
}


SLEPT: dict[torch.dtype, float] = {}  # seconds slept by Nap, by the dtype it was handed


def _sleep(dtype: torch.dtype, seconds: float) -> None:
    import time

    time.sleep(seconds)
    SLEPT[dtype] = SLEPT.get(dtype, 0.0) + seconds


class _NapInBackward(torch.autograd.Function):
    """Identity whose backward sleeps (a slow backward kernel, planted)."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds, ctx.dtype = seconds, h.dtype
        return h.view_as(h)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        _sleep(ctx.dtype, ctx.seconds)
        return g, None


class Nap(nn.Module):
    """Sleeps the seconds it is given (in its forward, or in its backward where `backward`),
    counted in SLEPT: a piece of a planted slow step."""

    def __init__(self, backward: bool = False) -> None:
        super().__init__()
        self.backward = backward

    def forward(self, h: torch.Tensor, seconds: float) -> torch.Tensor:
        if self.backward and torch.is_grad_enabled():
            return _NapInBackward.apply(h, seconds)
        if not self.backward:
            _sleep(h.dtype, seconds)
        return h


class SleepyOverflow(ForwardOverflow):
    """ForwardOverflow whose forward takes `per_sample` seconds a sample, `bf16_slowdown` times
    that under bf16 autocast (an AVX2 CPU's bf16, planted), slept in `pieces` naps: plain steps
    long and steady enough for the doctor's budget to be counted in them on any CPU, however
    loaded. `overflow=False`: the same model without the plant; `whole_batch_only`: bf16 slow on
    the whole batch only (a slice of it, as the doctor's probe takes, runs at fp32's speed);
    `slow_backward`: bf16's slowdown in the backward only (its forward at fp32's speed)."""

    def __init__(self, per_sample: float = 0.5 / 64, bf16_slowdown: float = 8.0,
                 overflow: bool = True, pieces: int = 1, whole_batch_only: bool = False,
                 slow_backward: bool = False) -> None:
        super().__init__()
        self.per_sample, self.bf16_slowdown, self.pieces = per_sample, bf16_slowdown, pieces
        self.whole_batch_only = whole_batch_only  # bf16 slow only on batches over 8 samples
        self.nap = Nap()
        self.slow_backward = Nap(backward=True) if slow_backward else None
        if not overflow:
            with torch.no_grad():
                self.up.weight.div_(3e5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        slow = self.bf16_slowdown if h.dtype == torch.bfloat16 and not (
            self.whole_batch_only and x.shape[0] <= 8) else 1.0
        for _ in range(self.pieces):
            if self.slow_backward is not None:  # the planted slowdown in the backward only
                h = self.nap(h, self.per_sample * x.shape[0] / self.pieces)
                h = self.slow_backward(h, self.per_sample * (slow - 1) * x.shape[0] / self.pieces)
            else:
                h = self.nap(h, self.per_sample * slow * x.shape[0] / self.pieces)
        return self.head(self.norm(self.up(h)))
