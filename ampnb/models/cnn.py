"""A small CNN and the synthetic images of oriented bars it learns to tell apart."""

from __future__ import annotations

import math

import torch
from torch import nn


class SmallCNN(nn.Module):
    """Two conv → ReLU → max-pool stages and a linear classifier, for 1×size×size images."""

    def __init__(self, width: int = 8, n_classes: int = 4, size: int = 16,
                 in_channels: int = 1) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Linear(2 * width * (size // 4) ** 2, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def bars(n: int, size: int = 16, n_classes: int = 4, noise: float = 0.2,
         generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """n noisy images [n, 1, size, size] of a bar whose orientation is the label [n]."""
    labels = torch.randint(0, n_classes, (n,), generator=generator)
    theta = labels * (math.pi / n_classes)  # orientations spread evenly over half a turn
    centre = (torch.rand(n, 2, generator=generator) - 0.5) * (size / 3)
    coords = torch.arange(size, dtype=torch.float32) - (size - 1) / 2
    ys, xs = torch.meshgrid(coords, coords, indexing="ij")
    dx = xs - centre[:, 0, None, None]
    dy = ys - centre[:, 1, None, None]
    # Distance of each pixel from the line through the centre at angle theta.
    dist = (dx * torch.sin(theta)[:, None, None] - dy * torch.cos(theta)[:, None, None]).abs()
    along = (dx * torch.cos(theta)[:, None, None] + dy * torch.sin(theta)[:, None, None]).abs()
    image = ((dist < 1.0) & (along < size / 3)).float()
    image = image + noise * torch.randn(n, size, size, generator=generator)
    return image.unsqueeze(1), labels
