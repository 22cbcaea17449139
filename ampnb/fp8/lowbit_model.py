"""Weight-only low-bit quantization of a model's Linear layers, with the error per layer."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampnb.display import Table
from ampnb.fp8.lowbit import LowBitFormat, get_lowbit, roundtrip
from ampnb.fp8.scaling import sqnr


@dataclass(frozen=True)
class LayerError:
    """What a low-bit format did to one Linear layer."""

    name: str
    shape: tuple[int, ...]
    bits_per_param: float
    weight_sqnr_db: float
    max_abs_error: float
    output_sqnr_db: float | None = None


@dataclass(frozen=True)
class LowBitReport:
    """Per-layer storage and error of a weight-only low-bit model."""

    fmt: LowBitFormat
    layers: tuple[LayerError, ...]

    @property
    def quantized_bytes(self) -> float:
        return sum(e.bits_per_param * _numel(e.shape) for e in self.layers) / 8

    @property
    def fp32_bytes(self) -> int:
        return sum(4 * _numel(e.shape) for e in self.layers)

    def table(self) -> Table:
        rows = [(e.name, "×".join(map(str, e.shape)), f"{e.bits_per_param:.3f}",
                 f"{e.weight_sqnr_db:.1f}", f"{e.max_abs_error:.3g}",
                 "-" if e.output_sqnr_db is None else f"{e.output_sqnr_db:.1f}")
                for e in self.layers]
        note = (f"Linear weights: {self.quantized_bytes:,.0f} bytes in {self.fmt.name} vs "
                f"{self.fp32_bytes:,} bytes in fp32 ({self.fp32_bytes / self.quantized_bytes:.2f}× smaller)")
        return Table(("layer", "weight", "bits/param", "weight SQNR dB", "max |error|",
                      "output SQNR dB"), rows, caption=f"{self.fmt.name}: {self.fmt.description}",
                     notes=(note,))

    def _repr_html_(self) -> str:
        return self.table()._repr_html_()

    def __repr__(self) -> str:
        return repr(self.table())


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _linear_outputs(model: nn.Module, inputs: Any) -> dict[str, torch.Tensor]:
    """Output of every Linear layer for one forward pass (hooks removed afterwards)."""
    outs: dict[str, torch.Tensor] = {}
    handles = [m.register_forward_hook(lambda _m, _i, o, n=name: outs.__setitem__(n, o.detach()))
               for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    try:
        with torch.no_grad():
            model(*inputs) if isinstance(inputs, tuple) else model(inputs)
    finally:
        for h in handles:
            h.remove()
    return outs


def quantize_model(model: nn.Module, fmt: str | LowBitFormat, *, inplace: bool = False,
                   inputs: Any = None, use_bitsandbytes: bool = True) -> tuple[nn.Module, LowBitReport]:
    """Round every Linear weight through a low-bit format (weight-only; compute stays as it was).

    `inplace=False` (default) works on a deep copy. With `inputs`, each layer's output is
    compared with the original model's (output SQNR); a tied weight is quantized once.
    """
    f = get_lowbit(fmt)
    target = model if inplace else copy.deepcopy(model)
    before = _linear_outputs(model, inputs) if inputs is not None and not inplace else None
    errors, done = [], set()
    for name, m in target.named_modules():
        if not isinstance(m, nn.Linear) or id(m.weight) in done:
            continue
        done.add(id(m.weight))
        w = m.weight.detach()
        q = roundtrip(w, f, use_bitsandbytes=use_bitsandbytes)
        errors.append((name, tuple(w.shape), f.bits_per_param(w.shape), sqnr(w, q),
                       (w.float() - q.float()).abs().max().item()))
        with torch.no_grad():
            m.weight.copy_(q)
    if not errors:
        raise ValueError(f"{type(model).__name__} has no nn.Linear layers to quantize")
    after = _linear_outputs(target, inputs) if before is not None else None
    layers = tuple(LayerError(*e, None if after is None else sqnr(before[e[0]], after[e[0]]))
                   for e in errors)
    return target, LowBitReport(f, layers)
