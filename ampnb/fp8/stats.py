"""Watch FP8 recipes work: per layer and step the amax, scale, saturated/flushed fractions, SQNR."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampnb._interrupt import Guard
from ampnb.display import Table, TableView, format_percent
from ampnb.fp8.linear import Fp8Linear, Role
from ampnb.fp8.scaling import fp8_fractions, sqnr


@dataclass(frozen=True)
class CastRecord:
    """One FP8 cast of one tensor: its amax, the scale used, and what the format did to it."""

    layer: str
    role: str
    step: int
    format: str
    amax: float
    scale: float
    saturated: float  # fraction of values past the format's max after scaling
    flushed: float    # fraction of nonzero values that became 0

    @property
    def scaled_amax(self) -> float:
        """amax * scale: where the largest value landed in the format."""
        return self.amax * self.scale


@dataclass(frozen=True)
class OutputRecord:
    """A layer's FP8 output against the same layer computed in fp32."""

    layer: str
    step: int
    sqnr_db: float


class Fp8Stats(TableView):
    """Attach to every Fp8Linear of a model and record each cast; `detach()` (or `with`) ends it."""

    def __init__(self, model: nn.Module) -> None:
        self.casts: list[CastRecord] = []
        self.outputs: list[OutputRecord] = []
        self._names = {m: n for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
        if not self._names:
            raise ValueError(f"{type(model).__name__} has no Fp8Linear layers to watch; "
                             "convert it first with ampnb.fp8.convert_to_fp8")
        self._count: dict[tuple[str, str], int] = defaultdict(int)
        previous = {m: m.observer for m in self._names}

        def attach() -> None:
            for m in self._names:
                m.observer = self._observe

        def restore(_: None) -> None:
            for m, observer in previous.items():
                m.observer = observer

        # Every layer watched or (on an interrupt) none; detach() is this Guard's exit.
        self._attached = Guard(attach, restore)
        self._attached.apply()

    def _observe(self, layer: Fp8Linear, role: Role | None, x: torch.Tensor,
                 scale: torch.Tensor | None, q: torch.Tensor) -> None:
        name = self._names[layer]
        key = (name, role.name.lower() if role is not None else "output")
        step = self._count[key]
        self._count[key] += 1
        if role is None:
            self.outputs.append(OutputRecord(name, step, sqnr(x, q)))
            return
        fmt = layer.format_of(role)
        saturated, flushed = fp8_fractions(x.float() * scale, fmt)
        amax = x.detach().abs().amax().item() if x.numel() else 0.0
        self.casts.append(CastRecord(name, key[1], step, fmt.name, amax, scale.item(),
                                     saturated, flushed))

    def detach(self) -> None:
        """Stop recording and give each layer back its previous observer (once)."""
        self._attached.__exit__(None, None, None)

    def __enter__(self) -> Fp8Stats:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    @property
    def layers(self) -> list[str]:
        return list(self._names.values())

    def series(self, layer: str, role: str) -> list[CastRecord]:
        """Every cast of one tensor of one layer, in step order."""
        return [r for r in self.casts if r.layer == layer and r.role == role]

    def steps_table(self, layer: str, role: str = "input") -> Table:
        """Every cast of one tensor, step by step: the recipe at work."""
        records = self.series(layer, role)
        if not records:
            raise ValueError(f"no {role!r} casts recorded for layer {layer!r}; layers: "
                             f"{', '.join(self.layers)}; roles: input, weight, grad_output")
        rows = [(r.step, f"{r.amax:.4g}", f"{r.scale:.4g}", f"{r.scaled_amax:.4g}",
                 format_percent(r.saturated), format_percent(r.flushed)) for r in records]
        return Table(("step", "amax", "scale used", "amax×scale", "saturated", "flushed to 0"),
                     rows, caption=f"{layer} · {role} in {records[0].format}")

    def sqnr_by_layer(self) -> dict[str, float]:
        """Each layer's latest output SQNR (dB) against fp32."""
        return {r.layer: r.sqnr_db for r in self.outputs}

    def table(self) -> Table:
        """The latest cast of each tensor of each layer, with the layer's output SQNR."""
        latest = {(r.layer, r.role): r for r in self.casts}
        out = self.sqnr_by_layer()
        rows = [(r.layer, r.role, r.format, f"{r.amax:.3g}", f"{r.scale:.4g}",
                 f"{r.scaled_amax:.4g}", format_percent(r.saturated), format_percent(r.flushed),
                 f"{out[r.layer]:.1f}" if r.layer in out else "-")
                for r in latest.values()]
        return Table(("layer", "tensor", "format", "amax", "scale", "amax×scale", "saturated",
                      "flushed to 0", "output SQNR dB"), rows,
                     caption="FP8 casts, latest step of each tensor")
