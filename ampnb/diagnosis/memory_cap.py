"""The doctor's memory cap: work that would take the process past CAP times its peak before the
doctor started (the peak of the training that ran in it) is left out, as work past the budget is."""

from __future__ import annotations

import os
import resource
import sys

import torch

CAP = 1.5  # issue #25: the doctor's peak within 1.5x that of a process that only trains


def _peak_bytes() -> int:
    """The process's peak resident memory so far (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _resident_bytes() -> int:
    """Resident memory now (Linux's /proc; elsewhere the peak so far, which is not less)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return _peak_bytes()


class MemoryCap:
    """Whether more bytes fit under CAP times the peak the process (or the CUDA device) had
    reached when the doctor started."""

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.limit = CAP * (torch.cuda.max_memory_allocated(self.device) if self.cuda
                            else max(_peak_bytes(), _resident_bytes()))  # the peak lags a little

    def now(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.cuda else _resident_bytes()

    def fits(self, extra: int) -> bool:
        return self.now() + extra <= self.limit

    def why(self, extra: int) -> str:
        """Why work needing `extra` bytes was left out."""
        return (f"needs about {extra / 2**20:.0f} MiB more: past {CAP:g}x the peak memory before "
                f"the doctor, {self.limit / 2**20:.0f} MiB")
