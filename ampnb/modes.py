"""Precision modes: one small class per Lightning precision string.

Semantics follow Lightning Fabric's precision plugins (`MixedPrecision`, `HalfPrecision`,
`DoublePrecision`), with one deliberate difference: Fabric turns `16-mixed` on a CPU into
bf16 autocast with a warning, while ampnb runs what was asked for — real fp16 autocast and a
CPU `torch.amp.GradScaler` (torch >= 2.3) — so a learner can see fp16 behave (and be slow)
on any machine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ampnb import apex, legacy
from ampnb._interrupt import Guard
from ampnb._tree import map_tensors
from ampnb.display import Table, TableView, dtype_name
from ampnb.fp16_kernels import Fp16Kernels, fp16_kernel_context


@dataclass(frozen=True)
class Availability:
    """Whether a mode can run on a device, why not, and what would run instead.

    `ok` with a `reason` means it runs, but not natively (the reason says how, e.g. emulated).
    """

    ok: bool
    reason: str = ""
    fallback: str | None = None

    def __bool__(self) -> bool:
        return self.ok


def _set_default_dtype(dtype: torch.dtype) -> torch.dtype:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    return previous


def default_dtype(dtype: torch.dtype) -> Guard:
    """Set torch's default float dtype for the body; always restore it, also on an interrupt.

    A Guard, not a generator, so that no line runs between the body and the restore.
    """
    return Guard(lambda: _set_default_dtype(dtype), torch.set_default_dtype)


def guarded(context: contextlib.AbstractContextManager) -> Guard:
    """A context manager entered and exited whole: an interrupt cannot leave it half set up."""
    return Guard(context.__enter__, lambda _: context.__exit__(None, None, None))


def cast_floats(data: Any, dtype: torch.dtype) -> Any:
    """Cast every floating tensor inside data (any container ampnb walks) to dtype; leave the rest."""
    return map_tensors(lambda t: t.to(dtype) if torch.is_floating_point(t) else t, data)


def _device_type(device: str | torch.device) -> str:
    return torch.device(device).type


def _cuda_present(device: str | torch.device) -> Availability:
    if _device_type(device) == "cuda" and not torch.cuda.is_available():
        return Availability(False, "needs CUDA, which this machine does not have", "cpu")
    return Availability(True)


class PrecisionMode(TableView):
    """Base mode: full fp32, every hook a no-op. Subclasses override only what differs."""

    name: ClassVar[str] = ""
    aliases: ClassVar[tuple[Any, ...]] = ()
    autocast_dtype: ClassVar[torch.dtype | None] = None
    param_dtype: ClassVar[torch.dtype] = torch.float32
    uses_scaler: ClassVar[bool] = False
    description: ClassVar[str] = ""
    requirements: ClassVar[str] = "any device"

    @property
    def is_mixed(self) -> bool:
        """True when weights stay fp32 and autocast lowers the compute."""
        return self.autocast_dtype is not None

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype most matmuls run in under this mode."""
        return self.autocast_dtype or self.param_dtype

    def forward_context(self, device: str | torch.device = "cpu") -> contextlib.AbstractContextManager:
        """Context for the forward pass (and the loss)."""
        return contextlib.nullcontext()

    def module_init_context(self) -> contextlib.AbstractContextManager:
        """Context in which new modules get their parameters directly in param_dtype."""
        return contextlib.nullcontext()

    def kernel_context(self, device: str | torch.device = "cpu",
                       fp16_kernels: str | Fp16Kernels | None = None) -> contextlib.AbstractContextManager:
        """Context for the whole step (forward, backward, update): how its products run here.

        fp16 products on a CPU without fp16 units run as fp32 kernels rounded once (see
        `ampnb.fp16_kernels`; `fp16_kernels` None = the process-wide setting); else nothing.
        """
        if self.compute_dtype != torch.float16:
            return contextlib.nullcontext()
        return fp16_kernel_context(device, fp16_kernels)

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Return the module in this mode's parameter dtype (in place, as nn.Module.to)."""
        apex.needs_module(module, f"{self.name} convert_module")
        return module

    def convert_input(self, data: Any) -> Any:
        """Cast floating inputs the way the mode's forward expects them."""
        return data

    def convert_output(self, data: Any) -> Any:
        """Cast floating outputs back to the default dtype."""
        return cast_floats(data, torch.get_default_dtype())

    def make_scaler(self, device: str | torch.device = "cpu") -> torch.amp.GradScaler | None:
        """A fresh GradScaler for modes that need one, else None."""
        return None

    def availability(self, device: str | torch.device = "cpu") -> Availability:
        """Whether this mode can run on `device` here."""
        return _cuda_present(device)

    def check(self, device: str | torch.device = "cpu") -> None:
        """Raise a one-line ValueError when the mode cannot run on `device`."""
        found = self.availability(device)
        if not found.ok:
            instead = f"; use {found.fallback!r} instead" if found.fallback else ""
            raise ValueError(f"{self.name} on {str(device)!r} {found.reason}{instead}")

    def __repr__(self) -> str:
        return f"<PrecisionMode {self.name!r}>"

    def table(self) -> Table:
        """What the mode does: autocast and parameter dtypes, scaler, hardware."""
        rows = [
            ("autocast dtype", dtype_name(self.autocast_dtype)),
            ("parameter dtype", dtype_name(self.param_dtype)),
            ("GradScaler", "yes" if self.uses_scaler else "no"),
            ("needs", self.requirements),
        ]
        return Table(("", self.name), rows, caption=self.description)

    def master_weights(self, optimizer: torch.optim.Optimizer | None) -> contextlib.AbstractContextManager:
        """Around the optimizer step: the step runs on fp32 masters (APEX O2). None: every
        optimizer stepping inside (a %%amp cell)."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor,
                 scaler: torch.amp.GradScaler | None = None) -> torch.Tensor:
        """Fabric's `backward`: the loss, scaled when there is a GradScaler, backward; returns
        what was backpropagated (the scaled loss)."""
        scaled = loss if scaler is None else scaler.scale(loss)
        scaled.backward()
        return scaled

    def optimizer_step(self, optimizer: torch.optim.Optimizer,
                       scaler: torch.amp.GradScaler | None = None,
                       before_update: Callable[[], None] | None = None) -> bool:
        """Fabric's `optimizer_step`: unscale, `before_update` (clip), step or skip, update the
        scale; on the mode's master weights. True when optimizer.step() ran."""
        ran = []
        with self.master_weights(optimizer), Guard(
                lambda: optimizer.register_step_post_hook(lambda *_: ran.append(True)),
                lambda handle: handle.remove()):
            if scaler is not None and scaler.is_enabled():
                scaler.unscale_(optimizer)
                if before_update is not None:
                    before_update()
                scaler.step(optimizer)
                scaler.update()
            else:
                if before_update is not None:
                    before_update()
                optimizer.step()
        return bool(ran)


class MixedMode(PrecisionMode):
    """Weights stay fp32; forward runs under torch.autocast in the low dtype."""

    def forward_context(self, device: str | torch.device = "cpu") -> contextlib.AbstractContextManager:
        return guarded(torch.autocast(_device_type(device), dtype=self.autocast_dtype))

    def convert_input(self, data: Any) -> Any:
        # Fabric casts inputs to the autocast dtype; autocast casts them again where needed.
        return cast_floats(data, self.autocast_dtype)


class TrueMode(PrecisionMode):
    """Everything in one dtype: module cast, default dtype set while building and in forward."""

    def forward_context(self, device: str | torch.device = "cpu") -> contextlib.AbstractContextManager:
        return default_dtype(self.param_dtype)

    def module_init_context(self) -> contextlib.AbstractContextManager:
        return default_dtype(self.param_dtype)

    def convert_module(self, module: nn.Module) -> nn.Module:
        apex.needs_module(module, f"{self.name} convert_module")
        return module.to(dtype=self.param_dtype)

    def convert_input(self, data: Any) -> Any:
        return cast_floats(data, self.param_dtype)


class Fp32True(PrecisionMode):
    name = "32-true"
    aliases = (32, "32")
    description = "fp32 everywhere (the reference)"


class Fp16Mixed(MixedMode):
    name = "16-mixed"
    aliases = (16, "16")
    autocast_dtype = torch.float16
    uses_scaler = True
    description = "fp32 weights, fp16 autocast, GradScaler against gradient underflow"
    requirements = "CUDA for speed; runs on CPU (torch >= 2.3) without native fp16 units"

    def make_scaler(self, device: str | torch.device = "cpu") -> torch.amp.GradScaler:
        return torch.amp.GradScaler(_device_type(device))


class Bf16Mixed(MixedMode):
    name = "bf16-mixed"
    aliases = ("bf16",)
    autocast_dtype = torch.bfloat16
    description = "fp32 weights, bf16 autocast; bf16 has fp32's range, so no GradScaler"
    requirements = "CUDA compute capability >= 8.0, or a CPU"

    def availability(self, device: str | torch.device = "cpu") -> Availability:
        found = _cuda_present(device)
        if found.ok and _device_type(device) == "cuda" and not torch.cuda.is_bf16_supported():
            return Availability(False, "needs a GPU with bf16 (compute capability >= 8.0)", "16-mixed")
        return found


class Fp16True(TrueMode):
    name = "16-true"
    param_dtype = torch.float16
    description = "everything fp16: half the memory, no master weights, no loss scaling"
    requirements = "CUDA for speed; runs on CPU without native fp16 units"


class Bf16True(TrueMode):
    name = "bf16-true"
    param_dtype = torch.bfloat16
    description = "everything bf16: half the memory, updates smaller than bf16's eps are lost"
    requirements = Bf16Mixed.requirements

    def availability(self, device: str | torch.device = "cpu") -> Availability:
        found = Bf16Mixed.availability(self, device)
        return found if found.ok or found.fallback == "cpu" else Availability(False, found.reason, "16-true")


class Fp64True(TrueMode):
    name = "64-true"
    aliases = (64, "64")
    param_dtype = torch.float64
    description = "fp64 everywhere: a high-accuracy reference, slow on GPUs"


class TransformerEngine(PrecisionMode):
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

        return emulated_fp8_context(_device_type(device), self.param_dtype, self.fallback_dtype)

    def module_init_context(self) -> contextlib.AbstractContextManager:
        return default_dtype(self.param_dtype)

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Swap Linear and LayerNorm layers for TE's (real where it runs, else emulated), then cast
        the weights; a model that already has TE layers is left as it is, as Lightning does."""
        apex.needs_module(module, f"{self.name} convert_module")
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
        found = _cuda_present(device)
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


class _Legacy:
    """APEX's levels: they run where their native counterpart runs, labelled legacy."""

    def availability(self, device: str | torch.device = "cpu") -> Availability:
        found = super().availability(device)
        return Availability(True, apex.LEGACY) if found.ok else found


class ApexO0(_Legacy, Fp32True):
    name = "apex-O0"
    aliases = ("apex-o0",)
    description = f"APEX O0, {apex.LEGACY}: fp32 training"


class ApexO1(_Legacy, Fp16Mixed):
    name = "apex-O1"
    aliases = ("apex-o1",)
    description = (f"APEX O1, {apex.LEGACY}: fp32 weights, fp16 autocast (APEX patched torch "
                   "functions with its own op lists), dynamic loss scaling")


class ApexO2(_Legacy, PrecisionMode):
    """fp16 weights except batch norm, fp32 master weights in the optimizer, dynamic loss scaling."""

    name = "apex-O2"
    aliases = ("apex-o2", "apex")  # Lightning 1.x: amp_backend="apex" defaulted to amp_level="O2"
    param_dtype = torch.float16
    uses_scaler = True
    description = (f"APEX O2, {apex.LEGACY}: fp16 weights (batch norm fp32), fp32 master weights "
                   "in the optimizer, dynamic loss scaling")
    requirements = Fp16Mixed.requirements

    def convert_module(self, module: nn.Module) -> nn.Module:
        apex.needs_module(module, f"{self.name} convert_module")
        return apex.half_except_batchnorm(module)

    def convert_input(self, data: Any) -> Any:
        return cast_floats(data, torch.float16)  # APEX patched forward to cast inputs to fp16

    def make_scaler(self, device: str | torch.device = "cpu") -> torch.amp.GradScaler:
        return torch.amp.GradScaler(_device_type(device))

    def master_weights(self, optimizer: torch.optim.Optimizer | None) -> contextlib.AbstractContextManager:
        return apex.master_step_hooks() if optimizer is None else apex.master_step(optimizer)

    def table(self) -> Table:
        found = super().table()
        rows = (*found.rows, ("master weights", "fp32, in the optimizer"), ("batch norm", "fp32"))
        return Table(found.headers, rows, caption=found.caption)


class ApexO3(_Legacy, Fp16True):
    name = "apex-O3"
    aliases = ("apex-o3",)
    description = f"APEX O3, {apex.LEGACY}: pure fp16, no master weights, static loss scale 1"


MODES: dict[str, PrecisionMode] = {
    cls.name: cls()
    for cls in (
        Fp32True,
        Fp16Mixed,
        Bf16Mixed,
        Fp16True,
        Bf16True,
        Fp64True,
        TransformerEngine,
        TransformerEngineFloat16,
        ApexO0,
        ApexO1,
        ApexO2,
        ApexO3,
    )
}
ALIASES: dict[Any, str] = {alias: mode.name for mode in MODES.values() for alias in mode.aliases}


def get_mode(mode: str | int | PrecisionMode) -> PrecisionMode:
    """Look up a mode by Lightning string, legacy alias (16, "bf16", 32, 64, "apex"), Lightning
    1.x arguments ("Trainer(gpus=1, precision=16, amp_backend='apex', amp_level='O2')") or instance."""
    if isinstance(mode, PrecisionMode):
        return mode
    key = mode.strip().lower() if isinstance(mode, str) else mode
    if isinstance(key, (str, int)) and not isinstance(key, bool):
        if key in MODES:
            return MODES[key]
        if key in ALIASES:
            return MODES[ALIASES[key]]
        if isinstance(key, str) and "=" in key:  # a Lightning 1.x call: "Trainer(precision=16)"
            return get_mode(legacy.resolve(mode))
    aliases = ", ".join(f"{a!r}->{n}" for a, n in ALIASES.items())
    raise ValueError(
        f"unknown precision mode {mode!r}; choose one of {', '.join(MODES)} (aliases: {aliases}; "
        "or Lightning 1.x arguments such as \"Trainer(precision=16, amp_backend='apex')\")"
    )
