"""The candidates the doctor runs: a mode on the doctor's device, a TF32 setting, and how this
machine runs it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ampnb.cpu import cpu_native
from ampnb.device import support, tf32_context
from ampnb.fp16_kernels import Fp16Kernels, emulates_fp16
from ampnb.modes import PrecisionMode, get_mode
from ampnb.precision import Precision

REFERENCE = "32-true"
TF32 = "32-true+tf32"
DEFAULT = (REFERENCE, TF32, "bf16-mixed", "16-mixed", "bf16-true", "16-true", "transformer-engine")
FP16_KERNELS = "fp16 kernels"  # how fp16 runs on a CPU without fp16 units: a mode that runs here


@dataclass(frozen=True)
class Candidate:
    """One column of the doctor's evidence: a mode on a device (what `Precision.of` needs: each
    run binds its own, `bound`), TF32, and how it runs here."""

    name: str
    mode: PrecisionMode
    device: str
    tf32: str | None            # None, "on" or "emulate"
    native: bool
    how: str                    # "native", or how: "slow: ...", "fp16 kernels: ...", "emulated: ..."
    fp16_kernels: bool = False  # fp16 products run as fp32 kernels rounded once (CPU)

    @property
    def label(self) -> str:
        """'native', 'slow', 'fp16 kernels' (runs here at about fp32's speed) or 'emulated'
        (FP8, TF32 on a CPU: accuracy only)."""
        if self.native:
            return "native"
        return FP16_KERNELS if self.fp16_kernels else self.how.split(":")[0].split(" ")[0]

    def bound(self, scale: float | None = None) -> Precision:
        """The mode on its device with a fresh GradScaler where the mode uses one (a run's own:
        every run starts from the snapshot), starting at `scale` when given."""
        scaler = None
        if scale is not None and self.mode.uses_scaler:
            scaler = torch.amp.GradScaler(torch.device(self.device).type, init_scale=scale)
        return Precision.of(self.mode, device=self.device, scaler=scaler)

    def context(self) -> contextlib.ExitStack:
        """TF32 and fp16-kernel settings for a run of this candidate (forward and backward)."""
        stack = contextlib.ExitStack()
        stack.enter_context(tf32_context(self.tf32, self.device))
        kernels = Fp16Kernels.EMULATED if self.fp16_kernels else Fp16Kernels.NATIVE
        stack.enter_context(self.bound().kernel_context(fp16_kernels=kernels))
        return stack


def _tf32_candidate(device: str) -> Candidate:
    found = support("tf32", device)
    if found.ok:
        return Candidate(TF32, get_mode(REFERENCE), device, "on", True, "native")
    return Candidate(TF32, get_mode(REFERENCE), device, "emulate", False,
                     f"emulated: inputs of matmuls rounded to TF32 ({found.reason})")


def _fp16_kernels_candidate(mode: PrecisionMode, device: str) -> Candidate | None:
    """An fp16 mode on a CPU through ampnb's fp16 kernels: the products as fp32-accumulating
    tensor cores compute them, at about fp32's speed (no probe of torch's slow fallback here:
    the doctor measures this mode's own step)."""
    found = mode.availability(device)
    if not found.ok:
        return None
    why = "fp16_kernels='emulated'" if cpu_native("fp16") else "no native fp16 units on this CPU"
    return Candidate(mode.name, mode, device, None, False,
                     f"{FP16_KERNELS}: fp32 products of fp16-rounded inputs, rounded once to fp16 "
                     f"(as tensor cores compute; {why})" + (f"; {found.reason}" if found.reason
                                                             else ""), fp16_kernels=True)


def candidate(name: str, device: str) -> Candidate | None:
    """The candidate for a mode name on a device, or None when the mode cannot run there."""
    if name == TF32:
        return _tf32_candidate(device)
    mode = get_mode(name)
    if mode.compute_dtype == torch.float16 and emulates_fp16(device):
        return _fp16_kernels_candidate(mode, device)
    found = support(mode, device)
    if not found.ok:
        return None
    return Candidate(mode.name, mode, device, None, found.native,
                     "native" if found.native else found.reason)


def candidates(modes: Iterable[str] | None, device: str) -> tuple[list[Candidate], list[str]]:
    """(candidates that run here, reference first; lines naming those that cannot)."""
    names = list(DEFAULT if modes is None else modes)
    if isinstance(modes, str):
        names = [m.strip() for m in modes.split(",")]
    wanted = [n if n == TF32 else get_mode(n).name for n in names]
    if REFERENCE not in wanted:
        wanted.insert(0, REFERENCE)
    wanted = [REFERENCE] + [n for n in dict.fromkeys(wanted) if n != REFERENCE]
    found, skipped = [], []
    for name in wanted:
        if name == "64-true":
            continue  # always run as the reference check, never a candidate
        c = candidate(name, device)
        if c is None:
            skipped.append(f"{name}: {support(name, device).reason}")
        else:
            found.append(c)
    return found, skipped
