"""Swap nn.Linear for Fp8Linear, and say which layers stayed in higher precision and why."""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

from torch import nn

from ampnb.display import Table
from ampnb.fp8.linear import MATMULS, Fp8Linear
from ampnb.fp8.recipe import Fp8Recipe, from_recipe_name

# FP8 GEMMs need aligned shapes; Lightning's Transformer Engine plugin skips Linear layers
# whose in_features is not a multiple of 8 or out_features not a multiple of 16.
ALIGN_IN, ALIGN_OUT = 8, 16


@dataclass(frozen=True)
class LayerChoice:
    """One linear layer: whether it runs in FP8, and why not when it does not."""

    name: str
    in_features: int
    out_features: int
    fp8: bool
    reason: str = ""


@dataclass(frozen=True)
class Fp8Report:
    """Which linear layers of a model run in FP8 and which stay in higher precision."""

    layers: tuple[LayerChoice, ...]

    @property
    def converted(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.layers if c.fp8)

    @property
    def skipped(self) -> tuple[LayerChoice, ...]:
        return tuple(c for c in self.layers if not c.fp8)

    def message(self) -> str:
        """One line per skipped layer, for warnings and errors."""
        return "; ".join(f"{c.name or '(the model itself)'!r} ({c.reason})" for c in self.skipped)

    def table(self) -> Table:
        rows = [(c.name, f"{c.in_features}→{c.out_features}", "FP8" if c.fp8 else "higher",
                 c.reason or "-") for c in self.layers]
        return Table(("layer", "in→out", "precision", "why not FP8"), rows,
                     caption=f"{len(self.converted)} of {len(self.layers)} linear layers in FP8")

    def _repr_html_(self) -> str:
        return self.table()._repr_html_()

    def __repr__(self) -> str:
        return repr(self.table())


def unsupported_reason(linear: nn.Linear) -> str:
    """Why an FP8 GEMM cannot take this layer's shape ('' when it can)."""
    bad = []
    if linear.in_features % ALIGN_IN:
        bad.append(f"in_features {linear.in_features} is not a multiple of {ALIGN_IN}")
    if linear.out_features % ALIGN_OUT:
        bad.append(f"out_features {linear.out_features} is not a multiple of {ALIGN_OUT}")
    return " and ".join(bad)


def _choices(model: nn.Module) -> tuple[LayerChoice, ...]:
    out = []
    for name, m in model.named_modules():
        if isinstance(m, Fp8Linear):
            out.append(LayerChoice(name, m.in_features, m.out_features, True))
        elif isinstance(m, nn.Linear):
            reason = unsupported_reason(m) or "not converted"
            out.append(LayerChoice(name, m.in_features, m.out_features, False, reason))
    return tuple(out)


def fp8_report(model: nn.Module) -> Fp8Report:
    """Read off a model which linear layers run in FP8 now."""
    return Fp8Report(_choices(model))


def plan(model: nn.Module) -> Fp8Report:
    """Which linear layers `convert_to_fp8` would turn into FP8, without touching the model."""
    layers = []
    for name, m in model.named_modules():
        if isinstance(m, Fp8Linear):
            layers.append(LayerChoice(name, m.in_features, m.out_features, True))
        elif isinstance(m, nn.Linear):
            reason = unsupported_reason(m)
            layers.append(LayerChoice(name, m.in_features, m.out_features, not reason, reason))
    return Fp8Report(tuple(layers))


def _swap(module: nn.Module, recipe: Fp8Recipe, matmul: str, enabled: bool | None) -> None:
    for name, child in module.named_children():
        if isinstance(child, Fp8Linear):
            continue  # already FP8: converting twice changes nothing
        if isinstance(child, nn.Linear) and not unsupported_reason(child):
            setattr(module, name, Fp8Linear.from_linear(child, recipe, matmul, enabled))
        else:
            _swap(child, recipe, matmul, enabled)


def convert_to_fp8(model: nn.Module, recipe: Fp8Recipe | str | None = None, *,
                   inplace: bool = False, matmul: str = "auto",
                   enabled: bool | None = True) -> tuple[nn.Module, Fp8Report]:
    """Replace every FP8-able nn.Linear by an emulated Fp8Linear sharing its parameters.

    `inplace=False` (default) converts a deep copy so the original stays the fp32 reference.
    Layers an FP8 GEMM cannot take stay nn.Linear, with one warning naming them; a model with
    no FP8-able linear layer raises a ValueError and is left as it was. `enabled=None` makes
    the layers run FP8 only inside `fp8_autocast()`, as Transformer Engine's do.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"convert_to_fp8 needs an nn.Module, got {type(model).__name__}")
    before = plan(model)
    if not before.converted:
        why = before.message() or "it has no nn.Linear layers"
        raise ValueError(f"no layer of this {type(model).__name__} can run in FP8: {why}; "
                         "it would train entirely in higher precision")
    if matmul not in MATMULS:
        raise ValueError(f"matmul={matmul!r} is not allowed; allowed: {', '.join(MATMULS)}")
    if not (enabled is None or isinstance(enabled, bool)):
        raise ValueError(f"enabled={enabled!r} is not allowed; allowed: True, False or None")
    r = from_recipe_name(recipe)  # a bad recipe name fails here, before the model is touched
    target = model if inplace else copy.deepcopy(model)
    if isinstance(target, nn.Linear) and not isinstance(target, Fp8Linear):
        target = Fp8Linear.from_linear(target, r, matmul, enabled)  # a bare layer is its own root
    _swap(target, r, matmul, enabled)
    report = fp8_report(target)
    if report.skipped:
        warnings.warn(f"FP8: {len(report.skipped)} linear layer(s) stay in higher precision: "
                      f"{report.message()}. Pad them to use FP8.", stacklevel=2)
    return target, report


def revert_fp8(model: nn.Module) -> nn.Module:
    """Swap every Fp8Linear back to nn.Linear, in place, sharing the same parameters."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Fp8Linear):
                plain = nn.Linear(child.in_features, child.out_features,
                                  bias=child.bias is not None, device="meta")
                plain.weight, plain.bias = child.weight, child.bias
                setattr(parent, name, plain)
    return model


def swap_for_mode(module: nn.Module, recipe: Fp8Recipe | str | None = None) -> nn.Module:
    """The transformer-engine modes' conversion: in place, FP8 only inside fp8_autocast.

    As Lightning does, layers FP8 cannot take are skipped with a warning rather than an error,
    also when that leaves no layer in FP8 (the warning then says the model runs in the
    weight dtype only).
    """
    before = plan(module)
    r = from_recipe_name(recipe)
    if isinstance(module, nn.Linear) and not unsupported_reason(module):
        module = Fp8Linear.from_linear(module, r, "auto", None)
    _swap(module, r, "auto", None)
    if before.skipped:
        none = "" if before.converted else " (no layer runs in FP8: the model computes in " \
                                           "its weight dtype only)"
        warnings.warn(f"FP8: {len(before.skipped)} linear layer(s) stay in higher precision"
                      f"{none}: {before.message()}. Pad them to use FP8.", stacklevel=3)
    return module
