"""Swap nn.Linear and transformers' Conv1D for Fp8Linear, and say what stayed in higher precision."""

from __future__ import annotations

import copy
import dataclasses
import html
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from ampnb.display import Table, TableView
from ampnb.fp8.backends import (
    Backend,
    choose,
    convert_torchao,
    real_fp8_backend,
    recipe_said,
    torchao_skip_reason,
)
from ampnb.fp8.layernorm import TeLayerNorm, replaceable
from ampnb.fp8.layernorm import unsupported_reason as ln_unsupported
from ampnb.fp8.layers import (  # noqa: F401 - ALIGN_IN/OUT: read from here too
    ALIGN_IN,
    ALIGN_OUT,
    CONVERTIBLE,
    ParameterShare,
    describe_left_out,
    kind_of,
    left_out,
    left_out_notes,
    not_convertible,
    parameter_share,
    swap_children,
    unsupported_reason,
)
from ampnb.fp8.linear import MATMULS, Fp8Linear
from ampnb.fp8.mx import MX_RECIPES, MxLinear, convert_to_mx
from ampnb.fp8.recipe import RECIPES, Fp8Recipe, from_recipe_name


@dataclass(frozen=True)
class LayerChoice:
    """One matmul layer: its type, whether it runs in FP8, and why not when it does not."""

    name: str
    kind: str  # a CONVERTIBLE name: "Linear", "Conv1D"
    in_features: int
    out_features: int
    fp8: bool
    reason: str = ""


@dataclass(frozen=True, repr=False)
class Fp8Report(TableView):
    """Which matmul layers run in FP8, which stay in higher precision, and what else was left out."""

    layers: tuple[LayerChoice, ...]
    left_out: tuple[tuple[str, int], ...] = ()  # other modules with parameters, by type
    params: ParameterShare = ParameterShare()  # the FP8 layers' weights among all parameters
    backend: Backend | None = None  # convert_to_fp8's: which backend converted, and why

    def __repr__(self) -> str:
        first = f"{self.backend.line()}\n" if self.backend else ""  # the backend, then the layers
        return f"{first}{self.table()!r}"

    def _repr_html_(self) -> str:
        first = f"<p>{html.escape(self.backend.line())}</p>" if self.backend else ""
        return f"{first}{self.table()._repr_html_()}"

    @property
    def headline(self) -> str:
        """'8 of 9 linear layers in FP8', with the share of parameters when a large module is left out."""
        text = f"{len(self.converted)} of {len(self.layers)} linear layers in FP8"
        if self.params.worth_saying:
            text += (f", {self.params.percent} of the parameters; "
                     f"left out: {describe_left_out(self.left_out)}")
        return text

    @property
    def converted(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.layers if c.fp8)

    @property
    def skipped(self) -> tuple[LayerChoice, ...]:
        return tuple(c for c in self.layers if not c.fp8)

    def message(self) -> str:
        """One entry per skipped layer, for warnings and errors."""
        return "; ".join(f"{c.name or '(the model itself)'!r} ({c.kind} "
                         f"{c.in_features}→{c.out_features}: {c.reason})" for c in self.skipped)

    @property
    def advice(self) -> str:
        """What would put the skipped layers in FP8, where padding would ('' otherwise)."""
        return " Pad them to use FP8." if any("multiple of" in c.reason for c in self.skipped) else ""

    def table(self) -> Table:
        rows = [(c.name, c.kind, f"{c.in_features}→{c.out_features}",
                 "FP8" if c.fp8 else "higher", c.reason or "-") for c in self.layers]
        notes = left_out_notes(self.left_out, f"not {' or '.join(CONVERTIBLE)}")
        return Table(("layer", "type", "in→out", "precision", "why not FP8"), rows,
                     caption=self.headline,
                     notes=notes)


def _report(model: nn.Module, planned: bool) -> Fp8Report:
    layers, taken, weights = [], [], []
    for name, m in model.named_modules():
        if isinstance(m, Fp8Linear) or real_fp8_backend(m):
            kind = "Conv1D" if getattr(m, "transposed", False) else "Linear"
            layers.append(LayerChoice(name, kind, m.in_features, m.out_features, True))
            weights.append(m.weight)
        elif (kind := kind_of(m)) is not None:
            n_in, n_out = kind.features(m)
            reason = unsupported_reason(m)
            fp8 = planned and not reason
            layers.append(LayerChoice(name, kind.name, n_in, n_out, fp8,
                                      reason or ("" if fp8 else "not converted")))
            if fp8:
                weights.append(m.weight)
        elif (found := not_convertible(m)) is not None:
            n_in, n_out = found[0].features(m)
            layers.append(LayerChoice(name, found[0].name, n_in, n_out, False, found[1]))
        else:
            continue
        taken.append(m)
    return Fp8Report(tuple(layers), left_out(model, taken), parameter_share(model, taken, weights))


def fp8_report(model: nn.Module) -> Fp8Report:
    """Read off a model which matmul layers run in FP8 now."""
    return _report(model, planned=False)


def plan(model: nn.Module) -> Fp8Report:
    """Which layers `convert_to_fp8` would turn into FP8, without touching the model."""
    return _report(model, planned=True)


def _convert(model: nn.Module, recipe: Fp8Recipe, matmul: str, enabled: bool | None) -> nn.Module:
    """Swap every FP8-able layer, all or none (a layer used twice gets one Fp8Linear)."""
    def fits(m: nn.Module) -> bool:
        return not isinstance(m, Fp8Linear) and kind_of(m) is not None \
            and not unsupported_reason(m)

    if fits(model):
        return Fp8Linear.from_linear(model, recipe, matmul, enabled)  # a bare layer is the root
    made: dict[int, Fp8Linear] = {}
    swaps = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if fits(child):
                if id(child) not in made:
                    made[id(child)] = Fp8Linear.from_linear(child, recipe, matmul, enabled)
                swaps.append((parent, name, made[id(child)]))
    swap_children(swaps)
    return model


def _device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return torch.device("cpu") if p is None else p.device


def _check_options(matmul: str, enabled: bool | None, compile: bool | None) -> None:
    """ValueError naming an emulation or compile option that is not allowed."""
    if matmul not in MATMULS:
        raise ValueError(f"matmul={matmul!r} is not allowed; allowed: {', '.join(MATMULS)}")
    if not (enabled is None or isinstance(enabled, bool)):
        raise ValueError(f"enabled={enabled!r} is not allowed; allowed: True, False or None")
    if compile is not None and not isinstance(compile, bool):
        raise ValueError(f"compile={compile!r} is not allowed; allowed: None, True or False")


def _convert_by(chosen: Backend, target: nn.Module, r: Fp8Recipe, matmul: str,
                enabled: bool | None) -> nn.Module:
    """The model's layers converted by the chosen backend."""
    if chosen.name == "torchao":
        return convert_torchao(target, r, chosen.emulate)
    if chosen.name == "te":
        from ampnb.fp8.te import convert_to_te  # imports transformer_engine

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the report's warning names the same layers
            return convert_to_te(target)
    return _convert(target, r, matmul, enabled)


def convert_to_fp8(model: nn.Module, recipe: Fp8Recipe | str | None = None, *,
                   backend: str = "auto", inplace: bool = False, matmul: str = "auto",
                   enabled: bool | None = True, emulate: bool = False,
                   compile: bool | None = None) -> tuple[nn.Module, Fp8Report]:
    """Run the model's FP8-able nn.Linear / Conv1D layers in FP8; returns `(model, report)`.

    `backend`: "te" (Transformer Engine's layers), "torchao" (its `convert_to_float8_training`),
    both on a CUDA GPU of compute capability >= 8.9 where the package is installed; "ampnb"
    (an emulated Fp8Linear sharing each layer's parameters, any device); "auto" takes the first
    of te, torchao, ampnb that runs here, and the report's first line says which and why.
    `recipe="mxfp8"`: MXFP8 layers (`ampnb.fp8.mx`; backend "auto", "torchao" or "ampnb").
    `recipe=None` is the backend's default (torchao: tensorwise; otherwise TE's DelayedScaling).
    `emulate=True` runs torchao's own emulation (`Float8LinearConfig(emulate=True)`), on a CPU
    too. `compile` wraps the result in `torch.compile`, as torchao's README does; None: on for
    the real backends. `inplace=False` (default) converts a deep copy so the original stays
    the fp32 reference. Layers an FP8 GEMM cannot take stay as they were, with one warning
    naming them; a model with no FP8-able layer raises a ValueError and is left as it was.
    `matmul` and `enabled` are the emulation's: `enabled=None` makes its layers run FP8 only
    inside `fp8_autocast()`, as Transformer Engine's do.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"convert_to_fp8 needs an nn.Module, got {type(model).__name__}")
    if isinstance(recipe, str) and recipe.strip().lower() in MX_RECIPES:  # block-scaled: fp8/mx.py
        if (matmul, enabled, emulate, compile) != ("auto", True, False, None):
            raise ValueError("matmul=, enabled=, emulate=, compile= are not allowed with recipe="
                             f"{recipe!r}; allowed: backend= and inplace=")
        return convert_to_mx(model, backend, inplace)
    before = plan(model)
    if not before.converted:
        why = before.message() or f"it has no {' or '.join(CONVERTIBLE)} layers"
        rest = describe_left_out(before.left_out)
        raise ValueError(f"no layer of this {type(model).__name__} can run in FP8: {why}"
                         f"{f' (left out: {rest})' if rest else ''}; "
                         "it would train entirely in higher precision")
    _check_options(matmul, enabled, compile)
    # A bad recipe name or backend fails here, before the model is touched.
    given = None if recipe is None else from_recipe_name(recipe)
    chosen = choose(backend, _device(model), given, emulate)
    if chosen.name != "ampnb" and (matmul != "auto" or enabled is not True):
        raise ValueError(f"matmul={matmul!r}, enabled={enabled!r} are not allowed with backend="
                         f"{chosen.name!r}; allowed: the defaults (they are the emulation's options)")
    r = given or RECIPES["tensorwise" if chosen.name == "torchao" else "delayed"]
    chosen = dataclasses.replace(chosen, recipe=recipe_said(chosen.name, r, given is None))
    target = model if inplace else copy.deepcopy(model)
    target = _convert_by(chosen, target, r, matmul, enabled)
    report = dataclasses.replace(fp8_report(target), backend=chosen)
    if chosen.name == "torchao":  # its own rule for which layers it takes
        report = dataclasses.replace(report, layers=tuple(
            c if c.fp8 or c.reason != "not converted" else
            dataclasses.replace(c, reason=torchao_skip_reason(target.get_submodule(c.name)))
            for c in report.layers))
    if report.skipped:
        warnings.warn(f"FP8: {len(report.skipped)} linear layer(s) stay in higher precision: "
                      f"{report.message()}.{report.advice}", stacklevel=2)
    if chosen.real if compile is None else compile:
        target = torch.compile(target)  # torchao's README: convert, then compile the model
    return target, report


def revert_fp8(model: nn.Module) -> nn.Module:
    """Put back the layer each Fp8Linear (or emulated TE LayerNorm) replaced, in place."""
    if isinstance(model, (Fp8Linear, TeLayerNorm, MxLinear)):
        return model.revert()
    back: dict[int, nn.Module] = {}  # a layer used twice comes back as one layer
    swaps = [(parent, name, back.setdefault(id(child), child.revert()))
             for parent in model.modules() for name, child in parent.named_children()
             if isinstance(child, (Fp8Linear, TeLayerNorm, MxLinear))]
    swap_children(swaps)
    return model


def has_te_layers(module: nn.Module) -> bool:
    """Whether the model already holds Transformer Engine layers, real or ampnb's emulated ones."""
    return any("transformer_engine" in type(m).__module__ or isinstance(m, (Fp8Linear, TeLayerNorm))
               for m in module.modules())


def _swap_layernorms(module: nn.Module) -> list[str]:
    """Swap every nn.LayerNorm for an emulated te.LayerNorm, as Fabric does; names left out."""
    skipped, swaps, made = [], [], {}
    for parent in module.modules():
        for name, child in parent.named_children():
            if replaceable(child):
                why = ln_unsupported(child)
                if why:
                    skipped.append(f"{name!r} ({why})")
                else:
                    swaps.append((parent, name, made.setdefault(id(child), TeLayerNorm(child))))
    swap_children(swaps)
    return skipped


def swap_for_mode(module: nn.Module, recipe: Fp8Recipe | str | None = None) -> nn.Module:
    """The transformer-engine precision's conversion: in place, FP8 only inside fp8_autocast.

    As Lightning does, Linear and LayerNorm layers are both replaced; a model that already has
    TE layers (real, or ampnb's) is left as it is; layers FP8 cannot take are skipped with a
    warning rather than an error, also when that leaves no layer in FP8 (the warning then says
    the model runs in the weight dtype only).
    """
    if has_te_layers(module):
        return module  # Fabric: "avoid converting if any is found. assume the user took care of it"
    before = plan(module)
    r = from_recipe_name(recipe)
    if replaceable(module) and not ln_unsupported(module):
        return TeLayerNorm(module)  # a bare LayerNorm is the root
    module = _convert(module, r, "auto", None)
    norms = _swap_layernorms(module)
    if before.skipped:
        none = "" if before.converted else " (no layer runs in FP8: the model computes in " \
                                           "its weight dtype only)"
        warnings.warn(f"FP8: {len(before.skipped)} linear layer(s) stay in higher precision"
                      f"{none}: {before.message()}.{before.advice}", stacklevel=3)
    if norms:
        warnings.warn(f"FP8: {len(norms)} LayerNorm(s) stay as they are: {'; '.join(norms)}",
                      stacklevel=3)
    return module
