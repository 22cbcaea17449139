"""Where the reference's tensors wait while the candidates stream past: on the device while under
the memory cap, then in host memory (pinned on CUDA), then on disk."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ampnb.diagnosis.memory_cap import MemoryCap
from ampnb.diagnosis.spill import Spill

HOST_SHARE = 0.25  # of the host's available memory, for a CUDA run's reference tensors


def _host_available() -> int:
    """Bytes of host memory available now (Linux); 0 where it cannot be read."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return 0


class Store(Mapping):
    """Tensors by name, each kept in the fastest tier with room: the device (under the doctor's
    memory cap), pinned host memory (a CUDA run, up to HOST_SHARE of what is free), or disk."""

    def __init__(self, root: str, cap: MemoryCap | None) -> None:
        self.cap = cap
        self.near: dict[str, torch.Tensor] = {}   # on the device or the host
        self.host_left = int(HOST_SHARE * _host_available()) if cap is not None and cap.cuda else 0
        self.disk = Spill(root)

    def put(self, name: str, t: torch.Tensor) -> None:
        t = t.detach()
        size = t.numel() * t.element_size()
        if self.cap is not None and self.cap.fits(size):
            self.near[name] = t
        elif size <= self.host_left:
            self.host_left -= size
            self.near[name] = t.to("cpu").pin_memory()  # host_left > 0 only for a CUDA run
        else:
            self.disk.put(name, t.cpu())

    def seal(self) -> None:
        """Write what waits for the disk."""
        self.disk.seal()

    def get(self, name: str, default: Any = None) -> Any:
        found = self.near.get(name)
        return found if found is not None else self.disk.get(name, default)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self:
            raise KeyError(name)
        return self.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self.near or name in self.disk

    def __iter__(self) -> Iterator[str]:
        return iter([*self.near, *self.disk])

    def __len__(self) -> int:
        return len(self.near) + len(self.disk)
