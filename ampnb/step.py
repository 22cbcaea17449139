"""The one training step under a mode (docs/design.md, "The step"), and the context a cell runs in.

A step means what torch's AMP recipe and Lightning Fabric mean: forward and loss under the
mode's autocast, backward with autocast off, the update through the mode's `optimizer_step`
(GradScaler, APEX masters), and no autocast-cached weight copy outliving an in-place update.
Every ampnb runner calls `train_step` (or `forward_loss` + the Precision's hooks) inside
`step_context`; a `%%amp` cell, on one process or on `--nproc` ranks, runs in `cell_context`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook

from ampnb._interrupt import Guard
from ampnb._weak import WeakIdMap
from ampnb.backwards import seen_everywhere
from ampnb.batch import Batch, step_loss
from ampnb.device import TF32Setting, tf32_context
from ampnb.fp16_kernels import Fp16Kernels
from ampnb.modes import PrecisionMode
from ampnb.putback_state import default_dtype_kept
from ampnb.selective import keep_fp32

_AUTOCAST_DEVICES = ("cpu", "cuda")


class ModeOnDevice(Protocol):
    """What a step uses of an `ampnb.Precision` (which sits above this module: its `step` runs
    `train_step`): the mode, the device it is bound to, the scaler (None: the mode uses none),
    and the mode's hooks with that device and scaler handed on (the only place they are)."""

    mode: PrecisionMode
    device: str
    scaler: torch.amp.GradScaler | None

    def forward_context(self) -> contextlib.AbstractContextManager: ...

    def kernel_context(self, *, fp16_kernels: Fp16Kernels | None = None
                       ) -> contextlib.AbstractContextManager: ...

    def backward(self, loss: torch.Tensor) -> torch.Tensor: ...

    def optimizer_step(self, optimizer: torch.optim.Optimizer,
                       before_update: Callable[[], None] | None = None) -> bool: ...


@dataclass(frozen=True)
class StepSettings:
    """A Precision (`ampnb.Precision.of`: the mode on its device, with its scaler) with a TF32
    setting (None: flags as they are), fp16 kernels (None: the process-wide setting) and module
    patterns kept in fp32."""

    precision: ModeOnDevice
    tf32: TF32Setting | None = None
    fp16_kernels: Fp16Kernels | None = None
    keep_fp32: tuple[str, ...] = ()

    @property
    def mode(self) -> PrecisionMode:
        return self.precision.mode

    @property
    def device(self) -> str:
        return self.precision.device


class _Entered(list):
    """What each context's __enter__ returned, and the stack that leaves them."""

    stack: contextlib.ExitStack


def _enter_all(contexts: Iterable[contextlib.AbstractContextManager]) -> _Entered:
    entered = _Entered()
    entered.stack = contextlib.ExitStack()
    try:
        for c in contexts:
            entered.append(entered.stack.enter_context(c))
    except BaseException:
        entered.stack.close()
        raise
    return entered


def all_of(contexts: Iterable[contextlib.AbstractContextManager]) -> Guard:
    """One context for several: all entered or none; leaving always completes.

    `as` gives the list of what each context's __enter__ returned.
    """
    return Guard(lambda: _enter_all(list(contexts)), lambda entered: entered.stack.close())


# ----- backward outside autocast, no stale autocast cache --------------------------------------


def _autocast_off(devices: list[str]) -> Guard:
    """Autocast off on `devices` (a Guard: an interrupt cannot leave it half put back)."""
    def enter() -> contextlib.ExitStack:
        # the forward's cached casts end where its backward starts (leaving the recipe's
        # autocast region drops them): the update that follows would make them stale
        torch.clear_autocast_cache()
        stack = contextlib.ExitStack()
        try:
            for d in devices:
                stack.enter_context(torch.autocast(d, enabled=False))
        except BaseException:
            stack.close()
            raise
        return stack

    return Guard(enter, lambda stack: stack.close())


def _outside_autocast(call: Callable[..., Any], roots: list[torch.Tensor]
                      ) -> contextlib.AbstractContextManager | None:
    on = [d for d in _AUTOCAST_DEVICES if torch.is_autocast_enabled(d)]
    return _autocast_off(on) if on else None


def backward_outside_autocast() -> Guard:
    """Every backward the body's code starts (Tensor.backward, autograd.backward, autograd.grad)
    runs with autocast off, as torch's recipe asks (in this thread; `ampnb.backwards`)."""
    return seen_everywhere(_outside_autocast)


def _clear_cache(*_: Any) -> None:
    torch.clear_autocast_cache()


class _Versions:
    """A global forward pre-hook: a module whose parameters were changed in place since their
    cast was cached (`w.add_(1)` between two forwards) drops the cache, as leaving the recipe's
    region would have; an unchanged weight keeps its one cast (a weight used twice)."""

    def __init__(self) -> None:
        self.seen: dict[int, int] = {}
        # each module's own parameters, read once: `parameters()` walks generators on every
        # forward of every module, the larger part of this hook's cost in a training loop
        self.own = WeakIdMap()

    def __call__(self, module: nn.Module, args: Any) -> None:
        own = self.own.get(module)
        if own is None:
            own = tuple(weakref.ref(p) for p in module.parameters(recurse=False))
            self.own[module] = own
        for ref in own:
            p = ref()
            # a Tensor's version counter is the one thing an in-place write always changes
            if p is not None and self.seen.get(id(p), p._version) != p._version:
                torch.clear_autocast_cache()
                self.seen.clear()
            if p is not None:
                self.seen[id(p)] = p._version


def fresh_autocast_weights() -> Guard:
    """The recipe's autocast cache: a leaf weight is cast once from a forward's first op to the
    start of its backward (`backward_outside_autocast` clears it there), and no cached copy
    outlives an in-place update (optimizer.step(), or a module's weight written in place)."""
    def enter() -> tuple[bool, Any, Any]:
        previous = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(True)
        torch.clear_autocast_cache()  # nothing cached before the cell is the cell's
        return (previous, register_optimizer_step_post_hook(_clear_cache),
                register_module_forward_pre_hook(_Versions()))

    def exit(state: tuple[bool, Any, Any]) -> None:
        previous, step_hook, forward_hook = state
        forward_hook.remove()
        step_hook.remove()
        torch.clear_autocast_cache()
        torch.set_autocast_cache_enabled(previous)

    return Guard(enter, exit)


# ----- the contexts ----------------------------------------------------------------------------


def _kept(models: nn.Module | Mapping[str, nn.Module] | None,
          patterns: tuple[str, ...]) -> list[contextlib.AbstractContextManager]:
    return [keep_fp32(models, patterns)] if models and patterns else []


def step_context(s: StepSettings, models: nn.Module | Mapping[str, nn.Module] | None = None
                 ) -> Guard:
    """What a whole step (forward, backward, update) runs in: TF32, the mode's products, the
    modules kept in fp32. `as` gives what each entered; [0] is the TF32 emulation or None."""
    return all_of([tf32_context(s.tf32, s.device),
                   s.precision.kernel_context(fp16_kernels=s.fp16_kernels),
                   *_kept(models, s.keep_fp32)])


def cell_context(s: StepSettings, models: nn.Module | Mapping[str, nn.Module] | None = None
                 ) -> Guard:
    """What a `%%amp` cell runs in (one process or a rank): everything under the mode's
    forward context except autograd's backward; optimizers step the mode's way (APEX masters);
    no autocast-cached weight outlives an update; a default dtype the cell sets is put back
    under every mode. `as` [0] is the TF32 emulation or None, [-1] the `DefaultDtype`."""
    return all_of([tf32_context(s.tf32, s.device),
                   s.precision.kernel_context(fp16_kernels=s.fp16_kernels),
                   s.mode.module_init_context(), s.precision.forward_context(),
                   fresh_autocast_weights(), backward_outside_autocast(),
                   s.mode.master_weights(None), *_kept(models, s.keep_fp32),
                   default_dtype_kept()])  # innermost: it sees what the cell itself left


# ----- the step --------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class StepOutcome:
    """One step: the loss (detached), the model's raw output, the scale used, whether skipped."""

    loss: torch.Tensor
    output: Any
    scale: float | None
    skipped: bool


def forward_loss(precision: ModeOnDevice, model: Callable[..., Any], batch: Batch,
                 loss_fn: Callable[..., Any] | None) -> tuple[Any, torch.Tensor]:
    """The model's forward and the loss under the mode's forward context on the Precision's
    device: (raw output, loss).

    Mixed modes are torch.amp's recipe: inputs as given, forward and loss in one autocast
    region, the outputs handed to the loss as the forward made them. True modes are Fabric's:
    floating inputs cast to the mode's dtype, outputs cast back before the loss.
    """
    mode, device = precision.mode, precision.device
    if mode.is_mixed:
        run = batch.to(device)
        with precision.forward_context():
            raw = run.call(model)
            return raw, step_loss(raw, run, loss_fn)
    run = batch.to(device).convert(mode.convert_input)
    with precision.forward_context():
        raw = run.call(model)
    out = mode.convert_output(raw)
    if loss_fn is None:  # the model's own loss: computed in its forward
        return raw, step_loss(out, run, None)
    with precision.forward_context():
        return raw, step_loss(out, run, loss_fn)


def train_step(precision: ModeOnDevice, model: Callable[..., Any],
               optimizer: torch.optim.Optimizer, batch: Batch,
               loss_fn: Callable[..., Any] | None = None, *,
               before_update: Callable[[], None] | None = None) -> StepOutcome:
    """zero_grad, forward + loss under the mode, the Precision's `backward` and
    `optimizer_step` (its scaler, on its device).

    `before_update` runs on unscaled gradients before the update (clip, read gradients).
    """
    optimizer.zero_grad(set_to_none=True)
    scaler = precision.scaler
    scale = None if scaler is None or not scaler.is_enabled() else float(scaler.get_scale())
    raw, loss = forward_loss(precision, model, batch, loss_fn)
    precision.backward(loss)
    stepped = precision.optimizer_step(optimizer, before_update=before_update)
    return StepOutcome(loss.detach(), raw, scale, not stepped)
