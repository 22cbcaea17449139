"""The plain records the doctor's stages pass along: the plan, the run's settings, the checks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ampnb.diagnosis.candidates import Candidate
from ampnb.diagnosis.tolerance import Tolerance


@dataclass(frozen=True, eq=False)
class Plan:
    """The candidates stage: the reference, the modes timed in the headline (native, slow, or
    fp16 through ampnb's fp16 kernels),
    the emulated ones (accuracy only: their speed here says nothing), and those that cannot run."""

    reference: Candidate
    headline: tuple[Candidate, ...]
    emulated: tuple[Candidate, ...]
    skipped: tuple[str, ...]


@dataclass(frozen=True, eq=False)
class Settings:
    """The run's options the stages read (keyword-only, as the user passed them)."""

    tol: Tolerance
    repeat: int = 3
    profile: bool = True
    train: bool = True
    batches: Any = None
    scheduler: Any = None
    say: Callable[[str], None] = print


@dataclass(frozen=True, eq=False)
class Checks:
    """The training (or inference) checks stage: per mode, its check."""

    checks: dict[str, Any] = field(default_factory=dict)
