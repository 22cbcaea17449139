"""The stepper's knobs as one frozen, validated record (bad values fail before anything runs)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# name -> (is it allowed?, the allowed range in words). A table, not an if-chain.
_RULES = {
    "accumulation_steps": (lambda v: _count(v) and v >= 1, "an integer >= 1"),
    "clip_norm": (lambda v: v is None or (_number(v) and v >= 0), "None (off) or a number >= 0 (0 = off)"),
    "init_scale": (lambda v: _number(v) and v > 0, "a finite number > 0"),
    "growth_factor": (lambda v: _number(v) and v > 1, "a finite number > 1"),
    "backoff_factor": (lambda v: _number(v) and 0 < v < 1, "a number in (0, 1)"),
    "growth_interval": (lambda v: _count(v) and v >= 1, "an integer >= 1"),
}


@dataclass(frozen=True)
class ScalerSettings:
    """GradScaler arguments plus the loop's accumulation and clipping."""

    accumulation_steps: int = 1
    clip_norm: float | None = None
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        for f in fields(self):
            ok, allowed = _RULES[f.name]
            value = getattr(self, f.name)
            if not ok(value):
                raise ValueError(f"{f.name}={value!r} is not allowed; it must be {allowed}.")

    @property
    def clipping(self) -> bool:
        """nanoGPT's convention: clip_norm None or 0 means no clipping."""
        return bool(self.clip_norm)

    def scaler_kwargs(self) -> dict[str, float | int]:
        return {"init_scale": float(self.init_scale), "growth_factor": float(self.growth_factor),
                "backoff_factor": float(self.backoff_factor),
                "growth_interval": int(self.growth_interval)}
