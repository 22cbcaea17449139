"""Per-module evidence: end-to-end and local forward error, activation range and headroom."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ampnb._tree import map_tensors
from ampnb.diagnosis.candidates import Candidate
from ampnb.diagnosis.errors import NOT_COMPARED, Err, compare, headroom
from ampnb.diagnosis.run import Setup, StepResult, _first_floats
from ampnb.formats import get_format

# Modules whose output depends on the random state: re-running one alone draws other numbers.
RANDOM = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)


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


def _run_alone(module: nn.Module, inputs: Any, cand: Candidate, setup: Setup) -> torch.Tensor | None:
    args, kwargs = inputs
    mode = cand.mode
    torch.manual_seed(setup.seed)
    with torch.no_grad(), cand.context(setup.device), mode.forward_context(setup.device):
        out = module(*mode.convert_input(args), **mode.convert_input(kwargs))
    return _first_floats(out)


def local_errors(setup: Setup, ref: StepResult, cands: list[Candidate]) -> dict[str, dict[str, Err]]:
    """Each leaf module run alone in each candidate on the reference's fp32 inputs, vs fp32."""
    mods = dict(setup.start.model_copy(cands[0].mode, setup.device).named_modules())
    alone = {name: _run_alone(mods[name], map_tensors(torch.clone, inp), cands[0], setup)
             for name, inp in ref.inputs.items() if not isinstance(mods[name], RANDOM)}
    found: dict[str, dict[str, Err]] = {name: {} for name in alone}
    for cand in cands[1:]:
        net = setup.start.model_copy(cand.mode, setup.device)
        converted = dict(net.named_modules())
        for name, want in alone.items():
            if want is None or name not in converted:
                continue
            try:
                got = _run_alone(converted[name], ref.inputs[name], cand, setup)
            except (RuntimeError, TypeError, ValueError):  # e.g. an op without a kernel for the dtype
                got = None
            found[name][cand.name] = NOT_COMPARED if got is None else compare(got, want)
    return found


def layer_rows(model: nn.Module, ref: StepResult, runs: dict[str, StepResult],
               local: dict[str, dict[str, Err]], formats: tuple[str, ...]) -> tuple[LayerRow, ...]:
    """One row per module that produced a floating output, in the order they ran."""
    mods = dict(model.named_modules())
    rows = []
    for name, out in ref.outputs.items():
        module = mods.get(name)
        amax = ref.amax[name]
        rows.append(LayerRow(
            name, type(module).__name__ if module is not None else "?",
            module is not None and not any(True for _ in module.children()), amax,
            {f: headroom(amax, get_format(f).max) for f in formats},
            {c: compare(r.outputs[name], out) if name in r.outputs else NOT_COMPARED
             for c, r in runs.items()},
            local.get(name, {})))
    return tuple(rows)


def worst_local(rows: tuple[LayerRow, ...], cand: str, limit: float) -> list[str]:
    """Leaf modules whose local error in a candidate is above limit, worst first."""
    scored = [(r.local[cand].rel, r.module) for r in rows
              if cand in r.local and not math.isnan(r.local[cand].rel) and r.local[cand].rel > limit]
    return [m for _, m in sorted(scored, key=lambda x: -x[0])]
