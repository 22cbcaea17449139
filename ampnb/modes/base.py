"""The base of every precision mode: full fp32, every hook a no-op, and the helpers modes share.

Semantics follow Lightning Fabric's precision plugins (`Precision`): a mode overrides only what
differs. The families (`mixed`, `true`, `transformer_engine`, `apex_legacy`) build on this file;
it knows none of them, and nothing of display.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ampnb._checks import needs_module
from ampnb._interrupt import Guard
from ampnb._tree import map_tensors
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


def device_type(device: str | torch.device) -> str:
    return torch.device(device).type


def cuda_present(device: str | torch.device) -> Availability:
    if device_type(device) == "cuda" and not torch.cuda.is_available():
        return Availability(False, "needs CUDA, which this machine does not have", "cpu")
    return Availability(True)


BF16_REQUIREMENTS = "CUDA compute capability >= 8.0, or a CPU"


def bf16_present(device: str | torch.device, fallback: str) -> Availability:
    """Whether bf16 runs on `device` (CUDA needs compute capability >= 8.0), else `fallback`."""
    found = cuda_present(device)
    if found.ok and device_type(device) == "cuda" and not torch.cuda.is_bf16_supported():
        return Availability(False, "needs a GPU with bf16 (compute capability >= 8.0)", fallback)
    return found


class PrecisionMode:
    """Base mode: full fp32, every hook a no-op. Subclasses override only what differs.

    No display here: the modes ampnb ships show themselves through `ampnb.modes.view.ModeView`.
    """

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
        needs_module(module, f"{self.name} convert_module")
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
        return cuda_present(device)

    def check(self, device: str | torch.device = "cpu") -> None:
        """Raise a one-line ValueError when the mode cannot run on `device`."""
        found = self.availability(device)
        if not found.ok:
            instead = f"; use {found.fallback!r} instead" if found.fallback else ""
            raise ValueError(f"{self.name} on {str(device)!r} {found.reason}{instead}")

    def __repr__(self) -> str:
        return f"<PrecisionMode {self.name!r}>"

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

    def optimizer_step(self, optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
                       scaler: torch.amp.GradScaler | None = None,
                       before_update: Callable[[], None] | None = None) -> bool:
        """Fabric's `optimizer_step`: unscale, `before_update` (clip), step or skip, update the
        scale; on the mode's master weights. True when every optimizer.step() ran.

        Several optimizers follow torch's multi-optimizer recipe: each unscaled, `before_update`
        once, each stepped (or skipped on its own infs), then one update of the scale.
        """
        optimizers = tuple(optimizer) if isinstance(optimizer, (list, tuple)) else (optimizer,)
        ran: set[int] = set()

        def watch() -> list[Any]:
            return [o.register_step_post_hook(lambda o, *_: ran.add(id(o))) for o in optimizers]

        with Guard(watch, lambda handles: [h.remove() for h in handles]):
            self._on_masters(optimizers, lambda: _update(optimizers, scaler, before_update))
        return len(ran) == len(optimizers)

    def _on_masters(self, optimizers: tuple[torch.optim.Optimizer, ...], body: Callable[[], None]) -> None:
        """`body` inside each optimizer's `master_weights` (nested, one `with` per optimizer)."""
        if not optimizers:
            body()
            return
        with self.master_weights(optimizers[0]):
            self._on_masters(optimizers[1:], body)


def _update(optimizers: tuple[torch.optim.Optimizer, ...], scaler: torch.amp.GradScaler | None,
            before_update: Callable[[], None] | None) -> None:
    """torch's recipe: unscale_ each, before_update, step each (a scaler skips on infs), one update."""
    scaled = scaler is not None and scaler.is_enabled()
    if scaled:
        for o in optimizers:
            scaler.unscale_(o)
    if before_update is not None:
        before_update()
    for o in optimizers:
        if scaled:
            scaler.step(o)
        else:
            o.step()
    if scaled:
        scaler.update()
