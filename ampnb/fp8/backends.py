"""Which FP8 implementation runs a model: Transformer Engine, torchao, or ampnb's emulation.

As Lightning delegates FP8 to Transformer Engine: the real backends swap in their own layers
and run FP8 GEMMs on tensor cores (CUDA compute capability >= 8.9); ampnb's emulation runs the
same per-tensor recipe on any device. Neither real package is imported until it is used.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampnb.fp8.recipe import RECIPES, Fp8Format, Fp8Recipe, Scaling

# "auto" tries these in order and takes the first that runs here.
BACKENDS = ("te", "torchao", "ampnb")
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0) and newer
TORCHAO_ALIGN = 16  # torchao's README filter: FP8 GEMMs want in/out features divisible by 16


@dataclass(frozen=True)
class Backend:
    """The backend chosen for a model and why (the report's first line)."""

    name: str
    reason: str
    emulate: bool = False  # torchao's own emulation (Float8LinearConfig(emulate=True))
    recipe: str = ""  # the recipe its layers run (recipe_said), '' before conversion

    @property
    def real(self) -> bool:
        """Whether FP8 GEMMs run on FP8 tensor cores (what torch.compile is on by default for)."""
        return self.name != "ampnb" and not self.emulate

    def line(self) -> str:
        """'FP8 backend: ampnb (emulated in torch): ...'."""
        label = {"te": "Transformer Engine", "torchao": "torchao",
                 "ampnb": "ampnb (emulated in torch)"}[self.name]
        if self.emulate:
            label += " emulated (Float8LinearConfig(emulate=True))"
        recipe = f", recipe {self.recipe}" if self.recipe else ""
        return f"FP8 backend: {label}{recipe}: {self.reason}"


def recipe_said(backend: str, recipe: Fp8Recipe, default: bool) -> str:
    """The recipe a backend's layers run, for the report's first line: its name (else its
    fields); with `default` (recipe=None) on torchao, why it is not the ampnb backend's."""
    if backend == "te":  # TE's layers take theirs from fp8_autocast when they run
        return "set by fp8_autocast(fp8_recipe=) (Transformer Engine's default: DelayedScaling)"
    name = next((k for k, v in RECIPES.items() if v == recipe), None)
    text = f"{name} ({recipe.scaling.value} scaling)" if name else recipe.describe()
    if default and backend == "torchao":
        text += (" - torchao's default: torchao has no delayed scaling, the ampnb backend's "
                 "default (Transformer Engine's DelayedScaling)")
    return text


def fp8_gpu_problem(device: torch.device) -> str:
    """Why this device has no FP8 tensor cores ('' when it has)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return "needs a CUDA GPU with compute capability >= 8.9"
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        return f"this GPU has compute capability {cap[0]}.{cap[1]}; FP8 needs >= 8.9"
    return ""


@dataclass(frozen=True)
class TeStatus:
    """Whether Transformer Engine FP8 can run on a device, and why not."""

    ok: bool
    reason: str


def te_status(device: str | torch.device = "cuda") -> TeStatus:
    """Check the device and the package without importing Transformer Engine."""
    dev = torch.device(device)
    if why := fp8_gpu_problem(dev):
        return TeStatus(False, f"real FP8 {why}")
    if importlib.util.find_spec("transformer_engine") is None:
        return TeStatus(False, "transformer_engine is not installed")
    return TeStatus(True, f"Transformer Engine on {torch.cuda.get_device_name(dev)}")


def torchao_recipe_problem(recipe: Fp8Recipe) -> str:
    """Why torchao's float8 training cannot run this recipe ('' when it can)."""
    if recipe.scaling is not Scaling.DYNAMIC:
        return ("torchao scales dynamically (tensorwise) only, not delayed; allowed recipes: "
                "'tensorwise', 'dynamic', 'e4m3-dynamic'")
    if recipe.margin or not recipe.saturate:
        return "torchao has no margin and always saturates; allowed: margin=0, saturate=True"
    return ""


def status(name: str, device: torch.device, recipe: Fp8Recipe | None,
           emulate: bool = False) -> str:
    """Why `name` cannot run here ('' when it can), without importing its package."""
    if name == "ampnb":
        return ""
    if name == "te":
        found = te_status(device)
        return "" if found.ok else found.reason
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (pip install 'ampnb[fp8]')"
    if recipe is not None and (why := torchao_recipe_problem(recipe)):
        return why
    return "" if emulate else fp8_gpu_problem(device)


# What a user must know about a backend's layers once converted.
_NOTE = {"te": "; its layers compute FP8 inside transformer_engine.pytorch.fp8_autocast() only "
               "(the transformer-engine mode's forward_context enters it)"}


def choose(backend: str, device: torch.device, recipe: Fp8Recipe | None,
           emulate: bool = False) -> Backend:
    """The backend to use: the one named, or for "auto" the first in BACKENDS that runs here."""
    if backend not in ("auto", *BACKENDS):
        raise ValueError(f"backend={backend!r} is not allowed; allowed: 'auto', "
                         f"{', '.join(map(repr, BACKENDS))}")
    if not isinstance(emulate, bool) or emulate and backend != "torchao":
        raise ValueError(f"emulate={emulate!r} is not allowed with backend={backend!r}; allowed: "
                         "emulate=True only with backend='torchao' (its CPU emulation, for tests)")
    if backend != "auto":
        why = status(backend, device, recipe, emulate)
        if why:
            raise ValueError(f"backend={backend!r} cannot run here: {why}; allowed here: 'ampnb' "
                             "(the emulation) or 'auto'")
        return Backend(backend, "asked for" + _NOTE.get(backend, ""), emulate)
    why_not = []
    for name in BACKENDS:
        why = status(name, device, recipe)
        if not why:
            ran = "; ".join(why_not) or f"runs here ({device.type})"
            return Backend(name, f"auto: {ran}{_NOTE.get(name, '')}")
        why_not.append(f"{'Transformer Engine' if name == 'te' else name}: {why}")
    raise AssertionError("the ampnb backend always runs")  # pragma: no cover


def torchao_config(recipe: Fp8Recipe, emulate: bool) -> Any:
    """torchao's Float8LinearConfig for a per-tensor dynamic recipe (its 'tensorwise')."""
    from torchao.float8 import CastConfig, Float8LinearConfig

    if why := torchao_recipe_problem(recipe):
        raise ValueError(why)
    grad = recipe.backward_format.torch_dtype
    if recipe.fp8_format is Fp8Format.HYBRID:  # torchao's defaults: e4m3 forward, e5m2 gradients
        return Float8LinearConfig(emulate=emulate)
    cast = CastConfig(target_dtype=grad)
    return Float8LinearConfig(cast_config_grad_output=cast, emulate=emulate)


def torchao_filter(layer: nn.Module, fqn: str) -> bool:
    """The layers torchao converts: plain nn.Linear (not Conv1D) with aligned shapes."""
    from ampnb.fp8.layers import kind_of

    kind = kind_of(layer)
    return (kind is not None and kind.name == "Linear"
            and layer.in_features % TORCHAO_ALIGN == 0 and layer.out_features % TORCHAO_ALIGN == 0)


def torchao_skip_reason(layer: nn.Module) -> str:
    """Why torchao leaves a Linear / Conv1D layer in higher precision."""
    from ampnb.fp8.layers import kind_of

    if kind_of(layer).name != "Linear":
        return "torchao converts nn.Linear only"
    return f"torchao wants in and out features divisible by {TORCHAO_ALIGN}"


def convert_torchao(model: nn.Module, recipe: Fp8Recipe, emulate: bool) -> nn.Module:
    """torchao's convert_to_float8_training on the model, in place (Float8Linear layers)."""
    from torchao.float8 import convert_to_float8_training

    return convert_to_float8_training(model, module_filter_fn=torchao_filter,
                                      config=torchao_config(recipe, emulate))


def real_fp8_backend(m: nn.Module) -> str:
    """The backend of a torchao / Transformer Engine FP8 linear layer ('' for any other module)."""
    module = type(m).__module__
    if type(m).__name__ == "Float8Linear" and module.startswith("torchao."):
        return "torchao"
    # te.Linear and te.LayerNormLinear: Transformer Engine's layers with an FP8 GEMM.
    if (type(m).__name__.endswith("Linear") and module.startswith("transformer_engine.")
            and hasattr(m, "in_features")):
        return "te"
    return ""
