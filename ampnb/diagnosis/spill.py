"""The reference's module outputs and gradients, kept on disk while the candidates stream past."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch


class Spill(Mapping):
    """Tensors kept on disk by name, read back one at a time (the reference's module outputs and
    gradients): the candidates compare against them as they stream, so no run holds another's
    activations or gradients. Written in files of up to FILE_BYTES (one file per tensor costs
    more than the step on a small model), read back memory-mapped, one file at a time."""

    FILE_BYTES = 64 << 20

    def __init__(self, root: str) -> None:
        self.root = root
        self.where: dict[str, str] = {}          # name -> file
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.open: tuple[str, dict[str, torch.Tensor]] | None = None

    def put(self, name: str, t: torch.Tensor) -> None:
        self.pending[name] = t.detach()
        self.pending_bytes += t.numel() * t.element_size()
        if self.pending_bytes >= self.FILE_BYTES:
            self.seal()

    def seal(self) -> None:
        """Write what is pending to a file of its own."""
        if not self.pending:
            return
        path = os.path.join(self.root, f"t{len(set(self.where.values()))}.pt")
        torch.save(self.pending, path)
        self.where.update(dict.fromkeys(self.pending, path))
        self.pending, self.pending_bytes = {}, 0

    def get(self, name: str, default: Any = None) -> Any:
        if name in self.pending:
            return self.pending[name]
        path = self.where.get(name)
        if path is None:
            return default
        if self.open is None or self.open[0] != path:
            self.open = None  # drop the last file's mapping first
            self.open = (path, torch.load(path, mmap=True, weights_only=True))
        return self.open[1][name]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self:
            raise KeyError(name)
        return self.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self.where or name in self.pending

    def __iter__(self) -> Iterator[str]:
        return iter([*self.where, *self.pending])

    def __len__(self) -> int:
        return len(self.where) + len(self.pending)
