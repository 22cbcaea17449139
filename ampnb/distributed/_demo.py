"""The small model and global batch every distributed experiment trains (same on every rank)."""

from __future__ import annotations

import torch
from torch import nn

from ampnb.putback import generator, rng_kept
from ampnb.putback import seed as putback_seed

WIDTH, GLOBAL_BATCH = 16, 8


def model(seed: int = 0) -> nn.Module:
    """A 3-layer MLP, identical on every rank (same seed), small enough for fp16 on a CPU."""
    with rng_kept():  # the same weights on every rank; the caller's random streams untouched
        putback_seed(seed, "cpu")
        return nn.Sequential(nn.Linear(WIDTH, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                             nn.Linear(32, 4))


def batches(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` global batches (inputs, targets)."""
    g = generator(seed)
    return [(torch.randn(GLOBAL_BATCH, WIDTH, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g))
            for _ in range(steps)]


def shard(batch: tuple[torch.Tensor, torch.Tensor], rank: int, world_size: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's contiguous slice of a global batch (equal slices: DDP's mean is the global mean)."""
    if GLOBAL_BATCH % world_size:
        raise ValueError(f"the global batch of {GLOBAL_BATCH} does not split over {world_size} ranks")
    n = GLOBAL_BATCH // world_size
    return tuple(t[rank * n:(rank + 1) * n] for t in batch)  # type: ignore[return-value]
