"""Per-module evidence: end-to-end and local forward error, activation range and headroom."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch import nn

from ampnb.diagnosis.errors import NOT_COMPARED, Err
from ampnb.diagnosis.run import StepResult
from ampnb.formats import get_format, headroom


@dataclass(frozen=True)
class LayerRow:
    """One module: its reference range, headroom per format, and errors per candidate."""

    module: str
    kind: str
    leaf: bool
    amax: float                                            # reference (fp32) output amax
    headroom: dict[str, float] = field(default_factory=dict)   # format -> binades to its max
    end_to_end: dict[str, Err] = field(default_factory=dict)   # candidate -> error
    local: dict[str, Err] = field(default_factory=dict)        # candidate -> error (leaves)


def layer_rows(model: nn.Module, ref: StepResult, runs: dict[str, StepResult],
               formats: tuple[str, ...]) -> tuple[LayerRow, ...]:
    """One row per module that produced a floating output, in the order they ran (local errors:
    the reference's leaves run alone in each island candidate, see `run.measure`)."""
    mods = dict(model.named_modules())
    rows = []
    for name, amax in ref.amax.items():
        module = mods.get(name)
        rows.append(LayerRow(
            name, type(module).__name__ if module is not None else "?",
            module is not None and not any(True for _ in module.children()), amax,
            {f: headroom(amax, get_format(f).max) for f in formats},
            {c: r.end_to_end.get(name, NOT_COMPARED) if c != ref.name else Err(0.0, math.inf)
             for c, r in runs.items()},
            ref.local.get(name, {})))
    return tuple(rows)
