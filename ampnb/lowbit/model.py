"""Weight-only low-bit quantization of a model's Linear and Conv1D layers, with the error per layer."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampnb._interrupt import Guard, deferred
from ampnb.batch import as_batch
from ampnb.display import Table, TableView, format_bytes
from ampnb.fp8.layers import CONVERTIBLE, describe_left_out, kind_of, left_out
from ampnb.fp8.scaling import sqnr
from ampnb.lowbit.formats import LowBitFormat, get_lowbit, roundtrip


@dataclass(frozen=True)
class LayerError:
    """What a low-bit format did to one Linear / Conv1D layer (shape as (out, in))."""

    name: str
    shape: tuple[int, ...]
    bits_per_param: float
    weight_sqnr_db: float
    max_abs_error: float
    output_sqnr_db: float | None = None
    kind: str = "Linear"


@dataclass(frozen=True, repr=False)
class LowBitReport(TableView):
    """Per-layer storage and error of a weight-only low-bit model, and what it left out."""

    fmt: LowBitFormat
    layers: tuple[LayerError, ...]
    left_out: tuple[tuple[str, int], ...] = ()  # other modules with parameters, by type

    @property
    def quantized(self) -> tuple[tuple[str, int], ...]:
        """Layers quantized, counted by type: (('Conv1D', 8), ('Linear', 1))."""
        kinds = [e.kind for e in self.layers]
        return tuple((k, kinds.count(k)) for k in CONVERTIBLE if k in kinds)

    @property
    def quantized_bytes(self) -> float:
        return sum(e.bits_per_param * math.prod(e.shape) for e in self.layers) / 8

    @property
    def fp32_bytes(self) -> int:
        return sum(4 * math.prod(e.shape) for e in self.layers)

    def table(self) -> Table:
        rows = [(e.name, e.kind, "×".join(map(str, e.shape)), f"{e.bits_per_param:.3f}",
                 f"{e.weight_sqnr_db:.1f}", f"{e.max_abs_error:.3g}",
                 "-" if e.output_sqnr_db is None else f"{e.output_sqnr_db:.1f}")
                for e in self.layers]
        notes = [f"{describe_left_out(self.quantized)} weights: "
                 f"{format_bytes(self.quantized_bytes)} in {self.fmt.name} vs "
                 f"{format_bytes(self.fp32_bytes)} in fp32 "
                 f"({self.fp32_bytes / self.quantized_bytes:.2f}× smaller)"]
        if self.left_out:
            notes.append(f"left out (kept as they were): {describe_left_out(self.left_out)}")
        return Table(("layer", "type", "weight (out×in)", "bits/param", "weight SQNR dB",
                      "max |error|", "output SQNR dB"), rows,
                     caption=f"{self.fmt.name}: {self.fmt.description}", notes=tuple(notes))


def _layer_outputs(model: nn.Module, inputs: Any) -> dict[str, torch.Tensor]:
    """Output of every Linear / Conv1D layer for one eval-mode forward (model left as it was)."""
    outs: dict[str, torch.Tensor] = {}

    # Eval mode: dropout would draw different masks for the two models compared, and
    # BatchNorm in train mode would update the user's running statistics.
    def register() -> tuple[list[Any], list[tuple[nn.Module, bool]]]:
        modes = [(m, m.training) for m in model.modules()]
        model.eval()
        return [m.register_forward_hook(lambda _m, _i, o, n=name: outs.__setitem__(n, o.detach()))
                for name, m in model.named_modules() if kind_of(m) is not None], modes

    def restore(state: tuple[list[Any], list[tuple[nn.Module, bool]]]) -> None:
        handles, modes = state
        for h in handles:
            h.remove()
        for m, training in modes:
            m.training = training

    with Guard(register, restore), torch.no_grad():
        as_batch(inputs).call(model)
    return outs


def quantize_model(model: nn.Module, fmt: str | LowBitFormat, *, inplace: bool = False,
                   inputs: Any = None, use_bitsandbytes: bool = True) -> tuple[nn.Module, LowBitReport]:
    """Round every Linear / Conv1D weight through a low-bit format (weight-only; compute as it was).

    `inplace=False` (default) works on a deep copy. A Conv1D weight (stored (in, out)) is
    quantized in the (out, in) layout nn.Linear and bitsandbytes use. With `inputs` (a batch
    as `ampnb.batch.as_batch` reads it), each layer's output is compared with the original
    model's (output SQNR); a tied weight is quantized once. The report counts by type what
    was quantized and what was left out.
    """
    f = get_lowbit(fmt)
    if not isinstance(model, nn.Module):
        raise ValueError(f"quantize_model needs an nn.Module, got {type(model).__name__}")
    target = model if inplace else copy.deepcopy(model)
    before = _layer_outputs(model, inputs) if inputs is not None and not inplace else None
    errors, writes, done, taken = [], [], set(), []
    for name, m in target.named_modules():
        kind = kind_of(m)
        if kind is None:
            continue
        taken.append(m)
        if id(m.weight) in done:
            continue
        done.add(id(m.weight))
        w = kind.linear_weight(m).detach()
        q = roundtrip(w, f, use_bitsandbytes=use_bitsandbytes)
        errors.append((name, tuple(w.shape), f.bits_per_param(w.shape), sqnr(w, q),
                       (w.float() - q.float()).abs().max().item(), kind.name))
        writes.append((kind.linear_weight(m), q))
    rest = left_out(target, taken)
    if not errors:
        why = f" (it has {describe_left_out(rest)})" if rest else ""
        raise ValueError(f"{type(model).__name__} has no {' or '.join(CONVERTIBLE)} layers to "
                         f"quantize{why}")
    with deferred(), torch.no_grad():  # all or none: an interrupt waits for the last weight
        for view, q in writes:
            view.copy_(q)
    after = _layer_outputs(target, inputs) if before is not None else None
    layers = tuple(LayerError(name, shape, bits, w_db, err,
                              None if after is None else sqnr(before[name], after[name]), kind)
                   for name, shape, bits, w_db, err, kind in errors)
    return target, LowBitReport(f, layers, rest)
