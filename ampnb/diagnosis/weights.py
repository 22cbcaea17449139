"""What a step left in the weights: parameters inf/NaN and why, updates lost to rounding."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ampnb.apex import master_of
from ampnb.diagnosis.errors import lost_share
from ampnb.formats import get_format
from ampnb.modes import PrecisionMode
from ampnb.workbench.state import nonfinite_params


def weights(net: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter, by name."""
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def narrow(mode: PrecisionMode) -> bool:
    """Weights stored narrower than fp32, where an update can be lost to rounding."""
    return not mode.is_mixed and mode.param_dtype.itemsize < 4


def eps_causes(opt: torch.optim.Optimizer) -> list[str]:
    """Optimizer groups whose eps rounds to 0 in their weights' dtype (0/0 = NaN where a
    gradient entry is 0), e.g. 'AdamW eps=1e-08 is 0 in fp16'."""
    found = []
    for group in opt.param_groups:
        eps = group.get("eps")
        if not isinstance(eps, float) or eps <= 0:
            continue
        for dtype in dict.fromkeys(p.dtype for p in group["params"] if p.is_floating_point()):
            if float(torch.tensor(eps, dtype=dtype)) == 0:
                found.append(f"{type(opt).__name__} eps={eps!r} is 0 in {get_format(dtype).name}")
    return list(dict.fromkeys(found))


def weights_cause(bad: tuple[str, ...], total: int, causes: list[str]) -> str:
    """'the optimizer step left 1 of 3 parameters inf/NaN (emb.weight): <causes>, ...'."""
    where = f"the optimizer step left {len(bad)} of {total} parameters inf/NaN ({bad[0]}" + (
        ", ...)" if len(bad) > 1 else ")")
    if causes:
        return f"{where}: {'; '.join(causes)}, so every zero gradient entry gives 0/0 = NaN"
    return where


def weights_left(net: nn.Module, opt: torch.optim.Optimizer, before: dict[str, torch.Tensor],
                 ref: Any) -> dict[str, Any]:
    """StepResult's weight fields: parameters inf/NaN (and why, when known) and the share of
    the reference's (a StepResult) nonzero updates that left this mode's weight unchanged."""
    bad = nonfinite_params(net, opt)
    lost = None
    if before and ref is not None and ref.moved:  # the weight the optimizer keeps (APEX: master)
        lost = lost_share(ref.moved, before,
                          {n: master_of(p).detach() for n, p in net.named_parameters()})
    total = sum(1 for _ in net.parameters())
    return dict(bad_weights=bad, lost_updates=lost,
                weights_cause=weights_cause(bad, total, eps_causes(opt)) if bad else "")
