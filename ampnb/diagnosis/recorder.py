"""The doctor's per-module recorder: each module's output amax on a copy of the model, spilled
to disk (the reference) or compared with the reference's (a candidate), and each leaf's local
error when it runs alone in a candidate's arithmetic."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ampnb._tree import map_tensors, tensors
from ampnb.diagnosis.candidates import Candidate
from ampnb.diagnosis.errors import NOT_COMPARED, Err, compare
from ampnb.diagnosis.store import Store
from ampnb.putback import rng_kept

# Modules whose output depends on the random state: re-running one alone draws other numbers.
RANDOM = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)


def _first_floats(obj: Any) -> torch.Tensor | None:
    found = [t.detach().reshape(-1).float() for t in tensors(obj) if t.is_floating_point()]
    return torch.cat(found) if found else None


def _amax(t: torch.Tensor) -> float:
    if not t.numel():
        return math.nan
    top = float(t.abs().max())
    if math.isfinite(top):  # the common case: one pass, no mask
        return top
    a = t.abs()
    a = a[torch.isfinite(a)]
    return float(a.max()) if a.numel() else math.nan


def _run_alone(module: nn.Module, inputs: Any, cand: Candidate) -> torch.Tensor | None:
    """A leaf module alone on (a copy of) the given fp32 inputs, in a candidate's arithmetic."""
    args, kwargs = map_tensors(torch.clone, inputs)
    p = cand.bound()
    mode = p.mode
    if not mode.is_mixed:  # a true mode computes in its weights' dtype: a converted copy
        module = mode.convert_module(copy.deepcopy(module))
    with rng_kept():  # a module run aside must not move the reference's random stream
        try:
            with torch.no_grad(), cand.context(), p.forward_context():
                return _first_floats(module(*mode.convert_input(args), **mode.convert_input(kwargs)))
        except (RuntimeError, TypeError, ValueError):  # e.g. an op without a kernel for the dtype
            return None


class Recorder:
    """Forward hooks on every module of a copy, first call only: output amax, and the output
    spilled to disk (the reference) or compared with the reference's (a candidate); leaves of
    the reference also run alone in each `local` candidate (their local error), then drop it."""

    def __init__(self, net: nn.Module, device: str, spill: Store | None, ref: Store | None,
                 local: Sequence[Candidate] = ()) -> None:
        self.device, self.spill, self.ref, self.cands = device, spill, ref, tuple(local)
        self.amax: dict[str, float] = {}
        self.end_to_end: dict[str, Err] = {}
        self.local: dict[str, dict[str, Err]] = {}
        self.inputs: dict[str, Any] = {}
        self.handles = []
        for name, module in net.named_modules():
            if not name:
                continue
            alone = self.cands and not any(True for _ in module.children()) and not isinstance(
                module, RANDOM)
            if alone:
                self.handles.append(module.register_forward_pre_hook(self._in(name),
                                                                     with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._out(name, alone)))

    def _in(self, name: str) -> Callable:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            if name not in self.amax and name not in self.inputs:  # an in-place op overwrites
                self.inputs[name] = map_tensors(lambda t: t.detach().clone(), (args, kwargs))
        return hook

    def _out(self, name: str, alone: bool) -> Callable:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            if name in self.amax:
                return
            found = _first_floats(out)
            if found is None:
                self.inputs.pop(name, None)
                return
            self.amax[name] = _amax(found)
            if self.spill is not None:
                self.spill.put(name, found)
            if self.ref is not None and name in self.ref:
                self.end_to_end[name] = compare(found, self.ref.get(name))
            inputs = self.inputs.pop(name, None)
            if alone and inputs is not None:
                self.local[name] = {c.name: _local(module, inputs, c, found)
                                    for c in self.cands}
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.inputs.clear()


def _local(module: nn.Module, inputs: Any, cand: Candidate, want: torch.Tensor
           ) -> Err:
    got = _run_alone(module, inputs, cand)
    return NOT_COMPARED if got is None else compare(got, want)
