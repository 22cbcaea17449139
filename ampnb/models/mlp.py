"""A small MLP classifier and the two-dimensional spirals it learns to separate."""

from __future__ import annotations

import math

import torch
from torch import nn


class MLP(nn.Module):
    """Linear → GELU blocks ending in a linear classifier head."""

    def __init__(self, in_features: int = 2, width: int = 64, depth: int = 2,
                 n_classes: int = 3) -> None:
        super().__init__()
        sizes = [in_features] + [width] * depth
        layers: list[nn.Module] = []
        for a, b in zip(sizes[:-1], sizes[1:]):
            layers += [nn.Linear(a, b), nn.GELU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(sizes[-1], n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def spirals(n: int, n_classes: int = 3, noise: float = 0.1, turns: float = 1.0,
            generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """n points on interleaved spiral arms, one arm per class: (points [n, 2], labels [n])."""
    labels = torch.randint(0, n_classes, (n,), generator=generator)
    radius = torch.rand(n, generator=generator)
    # Each arm winds `turns` times outwards; arms are rotated evenly around the circle.
    angle = 2 * math.pi * turns * radius + labels * (2 * math.pi / n_classes)
    angle = angle + noise * torch.randn(n, generator=generator)
    points = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1)
    return points * 2.0, labels
