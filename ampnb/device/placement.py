"""Where work runs: the device of the data (the model's parameters, the batch); a stated device
only states it, and one that disagrees is an error naming both (docs/design.md, "the device follows
the data": autocast on a device the tensors are not on lowers nothing)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampnb._tree import tensors
from ampnb.device.hardware import get_device

AUTO = ("auto", None)  # "not stated": the data decides


@dataclass(frozen=True)
class Placement:
    """The device work runs on, and why it was chosen (shown on the report's first line)."""

    device: str  # a present device's name: "cpu", "cuda:0", "mps"
    why: str     # e.g. "where the model's parameters are"

    @property
    def type(self) -> str:
        return torch.device(self.device).type

    def __str__(self) -> str:
        return f"{self.device} ({self.why})"


def data_devices(value: Any) -> list[torch.device]:
    """The devices of the tensors in value (a module's parameters and buffers), first seen first."""
    if isinstance(value, nn.Module):
        found = [t.device for t in (*value.parameters(), *value.buffers())]
    else:
        found = [d for v in _leaves(value) for d in
                 ([p.device for p in (*v.parameters(), *v.buffers())] if isinstance(v, nn.Module)
                  else [v.device])]
    return list(dict.fromkeys(d for d in found if d.type != "meta"))


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)) and any(isinstance(v, nn.Module) for v in value):
        return [x for v in value for x in _leaves(v)]
    if isinstance(value, dict) and any(isinstance(v, nn.Module) for v in value.values()):
        return [x for v in value.values() for x in _leaves(v)]
    return [value] if isinstance(value, nn.Module) else tensors(value)


def _name(d: torch.device) -> str:
    return get_device(d).name


def _matches(stated: torch.device, d: torch.device) -> bool:
    """'cuda' (no index) states any CUDA device; 'cuda:1' only that one."""
    return stated.type == d.type and (stated.index is None or stated.index == (d.index or 0))


def place(sources: Iterable[tuple[str, Any]], stated: Any = None, *, flag: str = "device=",
          fallback: str = "no model or tensor was given") -> Placement:
    """The device of the first source that holds tensors ((label, value) pairs, e.g. ("the
    model's parameters", model)); `stated` ('auto'/None: not stated) must agree with it.

    With no tensors anywhere: the stated device, else torch's default device. ValueError names
    the data's device and the stated one when they disagree, or the devices when data is split.
    """
    want = None if stated in AUTO else torch.device(get_device(stated).name)
    for label, value in sources:
        found = data_devices(value)
        if not found:
            continue
        names = ", ".join(_name(d) for d in found)
        if want is not None:
            hit = [d for d in found if _matches(want, d)]
            if not hit:
                raise ValueError(f"{flag}{stated} but {label} are on {names}; allowed: "
                                 f"{_or(found)} (where they are), or move them first")
            return Placement(_name(hit[0]), f"where {label} are; {flag}{stated} agrees")
        if len({d.type for d in found}) > 1:
            raise ValueError(f"{label} are on {names}, several kinds of device; state which "
                             f"with {flag}{_or(found)}")
        return Placement(_name(found[0]), f"where {label} are")
    if want is not None:
        return Placement(_name(want), f"as stated: {flag}{stated}; {fallback}")
    default = torch.get_default_device()
    return Placement(_name(default), f"torch's default device: {fallback}")


def place_model(model: Any, stated: Any = None, *, also: Iterable[tuple[str, Any]] = (),
                flag: str = "device=", fallback: str = "no model or tensor was given") -> Placement:
    """Where a model runs: its parameters' device (None: no model), else that of `also`'s data
    (e.g. the batch), which `stated` only states: `place`, spelled once for every runner."""
    sources = [] if model is None else [("the model's parameters", model)]
    return place([*sources, *also], stated, flag=flag, fallback=fallback)


def _or(found: list[torch.device]) -> str:
    names = [_name(d) for d in found]
    return " or ".join(names) if len(names) <= 2 else ", ".join(names[:-1]) + " or " + names[-1]


def for_ranks(sources: Iterable[tuple[str, Any]], stated: Any = None, *, flag: str = "device=",
              fallback: str = "no model or tensor was given") -> Placement:
    """Where distributed ranks run: as `place`; with no data and no stated device, CUDA where
    present (each rank makes its data on the device it is given)."""
    sources = list(sources)
    if (stated in AUTO and torch.cuda.is_available()
            and not any(data_devices(v) for _, v in sources)):
        return Placement(_name(torch.device("cuda")),
                         f"the ranks' device: cuda when present; {fallback}")
    return place(sources, stated, flag=flag, fallback=fallback)
