"""Precision modes: one small class per Lightning precision string, one file per family.

Semantics follow Lightning Fabric's precision plugins (`MixedPrecision`, `HalfPrecision`,
`DoublePrecision`), with one deliberate difference: Fabric turns `16-mixed` on a CPU into
bf16 autocast with a warning, while ampnb runs what was asked for — real fp16 autocast and a
CPU `torch.amp.GradScaler` (torch >= 2.3) — so a learner can see fp16 behave (and be slow)
on any machine.

`base` (the base class and shared helpers; no display, no family) <- `view` (the table a
mode shows) <- the families `mixed`, `true`, `transformer_engine` (imports `ampnb.fp8`),
`apex_legacy` <- this registry.
"""

from __future__ import annotations

from typing import Any

from ampnb import legacy
from ampnb.modes.apex_legacy import ApexO0, ApexO1, ApexO2, ApexO3
from ampnb.modes.base import (
    Availability,
    PrecisionMode,
    cast_floats,
    default_dtype,
    guarded,
)
from ampnb.modes.block_scaled import EXTRA_MODES, TransformerEngineMxfp8
from ampnb.modes.mixed import Bf16Mixed, Fp16Mixed, MixedMode
from ampnb.modes.transformer_engine import (
    TransformerEngine,
    TransformerEngineFloat16,
    TransformerEnginePrecision,
)
from ampnb.modes.true import Bf16True, Fp16True, Fp32True, Fp64True, TrueMode
from ampnb.modes.view import ModeView

__all__ = ["ALIASES", "MODES", "ApexO0", "ApexO1", "ApexO2", "ApexO3", "Availability", "Bf16Mixed",
           "Bf16True", "Fp16Mixed", "Fp16True", "Fp32True", "Fp64True", "MixedMode", "ModeView",
           "PrecisionMode", "TransformerEngine", "TransformerEngineFloat16",
           "TransformerEngineMxfp8", "TransformerEnginePrecision", "TrueMode", "cast_floats", "default_dtype", "get_mode",
           "guarded"]

MODES: dict[str, PrecisionMode] = {
    cls.name: cls()
    for cls in (
        Fp32True,
        Fp16Mixed,
        Bf16Mixed,
        Fp16True,
        Bf16True,
        Fp64True,
        TransformerEngine,
        TransformerEngineFloat16,
        ApexO0,
        ApexO1,
        ApexO2,
        ApexO3,
    )
}
ALIASES: dict[Any, str] = {alias: mode.name for mode in MODES.values() for alias in mode.aliases}


def get_mode(mode: str | int | PrecisionMode) -> PrecisionMode:
    """Look up a mode by Lightning string, legacy alias (16, "bf16", 32, 64, "apex"), Lightning
    1.x arguments ("Trainer(gpus=1, precision=16, amp_backend='apex', amp_level='O2')") or instance."""
    if isinstance(mode, PrecisionMode):
        return mode
    key = mode.strip().lower() if isinstance(mode, str) else mode
    if isinstance(key, (str, int)) and not isinstance(key, bool):
        if key in MODES:
            return MODES[key]
        if key in ALIASES:
            return MODES[ALIASES[key]]
        extra = next((m for m in EXTRA_MODES.values() if key == m.name or key in m.aliases), None)
        if extra is not None:  # block-scaled: by name only, not in the sweeps over MODES
            return extra
        if isinstance(key, str) and "=" in key:  # a Lightning 1.x call: "Trainer(precision=16)"
            return get_mode(legacy.resolve(mode))
    aliases = ", ".join(f"{a!r}->{n}" for a, n in ALIASES.items())
    raise ValueError(
        f"unknown precision mode {mode!r}; choose one of {', '.join([*MODES, *EXTRA_MODES])} "
        f"(aliases: {aliases}; "
        "or Lightning 1.x arguments such as \"Trainer(precision=16, amp_backend='apex')\")"
    )
