"""FP8 modes (Lightning's Transformer Engine plugin): real with Transformer Engine on a GPU with
compute capability >= 8.9, emulated by `ampnb.fp8` elsewhere. Above `ampnb.fp8`, which never
imports the modes; fp8's modules load when a mode first needs them."""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

import torch
from torch import nn

from ampnb._checks import needs_module
from ampnb.display import dtype_name
from ampnb.modes.base import (
    Availability,
    PrecisionMode,
    cast_floats,
    cuda_present,
    default_dtype,
    device_type,
)
from ampnb.modes.view import ModeView


class TransformerEngine(PrecisionMode, ModeView):
    """FP8 with bf16 weights (Lightning's 'transformer-engine'): real with TE, emulated elsewhere."""

    name = "transformer-engine"
    param_dtype = torch.bfloat16
    description = ("FP8 matmuls (e4m3 forward, e5m2 backward) with per-tensor delayed scaling; "
                   "other ops under autocast in the weight dtype")
    requirements = ("any device (emulated FP8); real FP8: NVIDIA Transformer Engine on a GPU "
                    "with compute capability >= 8.9")
    recipe: ClassVar[Any] = None  # an Fp8Recipe; None is Transformer Engine's DelayedScaling()
    replace_layers: ClassVar[bool | None] = None  # Lightning's: None and True swap the layers
    fallback_compute_dtype: ClassVar[torch.dtype | None] = None  # autocast dtype; None: weights'

    @property
    def fallback_dtype(self) -> torch.dtype:
        """The dtype ops that do not run in FP8 compute in (Lightning's fallback autocast)."""
        return self.fallback_compute_dtype or self.param_dtype

    def _real(self, device: str | torch.device) -> bool:
        from ampnb.fp8.te import te_status

        return te_status(device).ok

    def forward_context(self, device: str | torch.device = "cpu") -> contextlib.AbstractContextManager:
        if self._real(device):
            from ampnb.fp8.te import te_forward_context

            return te_forward_context(self.recipe, self.param_dtype, self.fallback_dtype)
        from ampnb.fp8.autocast import emulated_fp8_context

        return emulated_fp8_context(device_type(device), self.param_dtype, self.fallback_dtype)

    def module_init_context(self) -> contextlib.AbstractContextManager:
        return default_dtype(self.param_dtype)

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Swap Linear and LayerNorm layers for TE's (real where it runs, else emulated), then cast
        the weights; a model that already has TE layers is left as it is, as Lightning does."""
        needs_module(module, f"{self.name} convert_module")
        if self.replace_layers is False:
            return module.to(dtype=self.param_dtype)
        param = next(module.parameters(), None)
        if param is not None and self._real(param.device):
            from ampnb.fp8.te import convert_to_te

            return convert_to_te(module).to(dtype=self.param_dtype)
        from ampnb.fp8.convert import swap_for_mode

        return swap_for_mode(module, self.recipe).to(dtype=self.param_dtype)

    def convert_input(self, data: Any) -> Any:
        return cast_floats(data, self.param_dtype)

    def availability(self, device: str | torch.device = "cpu") -> Availability:
        found = cuda_present(device)
        if not found.ok:
            return found
        from ampnb.fp8.te import te_status

        status = te_status(device)
        if status.ok:
            return Availability(True, f"real ({status.reason})")
        return Availability(True, f"emulated: {status.reason}")


class TransformerEngineFloat16(TransformerEngine):
    """FP8 with fp16 weights (Lightning's 'transformer-engine-float16')."""

    name = "transformer-engine-float16"
    param_dtype = torch.float16


class TransformerEnginePrecision(TransformerEngine):
    """Lightning's `TransformerEnginePrecision(weights_dtype=, recipe=, replace_layers=,
    fallback_compute_dtype=)` as a mode; `recipe` as Lightning takes it (a dict, a DelayedScaling)."""

    def __init__(self, *, weights_dtype: torch.dtype, recipe: Any = None,
                 replace_layers: bool | None = None,
                 fallback_compute_dtype: torch.dtype | None = None) -> None:
        from ampnb.fp8.recipe import from_te_recipe

        for label, value in (("weights_dtype", weights_dtype),
                             ("fallback_compute_dtype", fallback_compute_dtype)):
            if not (isinstance(value, torch.dtype) and value.is_floating_point
                    or value is None and label == "fallback_compute_dtype"):
                raise ValueError(f"{label}={value!r} is not allowed; allowed: a floating "
                                 "torch.dtype such as torch.bfloat16")
        if not (replace_layers is None or isinstance(replace_layers, bool)):
            raise ValueError(f"replace_layers={replace_layers!r} is not allowed; allowed: None, True, False")
        self.recipe = from_te_recipe(recipe)
        self.param_dtype, self.replace_layers = weights_dtype, replace_layers
        self.fallback_compute_dtype = fallback_compute_dtype
        self.name = TransformerEngineFloat16.name if weights_dtype == torch.float16 else TransformerEngine.name
        self.description = (f"{TransformerEngine.description}; weights {dtype_name(weights_dtype)}, "
                            f"recipe {self.recipe.describe()}")
