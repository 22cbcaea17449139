"""Putting back the global torch state: one frozen reader of every flag ampnb promises to
restore (TF32, matmul precision, autocast, dispatch and function modes, global module hooks),
the default dtype, and Guards that take them and put them back. Only torch is imported.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ampnb._interrupt import Guard


def _get(obj: object, attr: str) -> object:
    """Read a flag that only some torch builds have; None where it is absent."""
    try:
        return getattr(obj, attr)
    except (AttributeError, RuntimeError):
        return None


def _dispatch_stack() -> list:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return _get_current_dispatch_mode_stack()


def _dispatch_mode_depth() -> int:
    try:
        return len(_dispatch_stack())
    except Exception:  # noqa: BLE001 - private API; absent means "cannot tell"
        return -1


@functools.cache
def _emulated_ops() -> tuple:
    from ampnb.fp16_kernels import EMULATED

    return tuple(EMULATED)


def _product_kernels() -> tuple:
    """Where the CPU kernels of the products ampnb may emulate were registered: an override
    left behind (by ampnb's fp16 emulation or anyone) shows up as a changed entry."""
    from ampnb._kernels import current_kernel

    try:
        return tuple(sorted(repr(current_kernel(op, "CPU")) for op in _emulated_ops()))
    except (AttributeError, RuntimeError):  # an older torch without get_kernel
        return ()


@functools.cache
def _reader(fn_path: str) -> Callable[..., object] | None:
    """torch's function at a dotted path, or None where this build lacks it (resolved once)."""
    obj: object = torch
    try:
        for part in fn_path.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        return None
    return obj if callable(obj) else None


def _call(fn_path: str, *args: object) -> object:
    """Call a reader that only some torch builds have; None where it is absent or refuses."""
    fn = _reader(fn_path)
    if fn is None:
        return None
    try:
        return fn(*args)
    except (AttributeError, RuntimeError, TypeError):
        return None


_FP32_PAIRS = tuple((b, o) for b in ("generic", "cuda", "mkldnn") for o in ("all", "matmul", "conv", "rnn"))
_FP32_GETTER = "_C._get_fp32_precision_getter"


@functools.cache
def _fp32_readable() -> tuple[bool, ...]:
    """Which of _FP32_PAIRS this build can read (torch refuses some pairs; that never changes)."""
    getter = _reader(_FP32_GETTER)
    readable = []
    for b, o in _FP32_PAIRS:
        try:
            getter(b, o)  # type: ignore[misc]
            readable.append(True)
        except (AttributeError, RuntimeError, TypeError):
            readable.append(False)
    return tuple(readable)


def _fp32_precision_pairs() -> tuple:
    """Every raw (backend, op) fp32_precision entry, as torch >= 2.9 stores it (None: unreadable)."""
    getter = _reader(_FP32_GETTER)
    if getter is None:
        return tuple((b, o, None) for b, o in _FP32_PAIRS)
    try:
        return tuple((b, o, getter(b, o) if ok else None)
                     for (b, o), ok in zip(_FP32_PAIRS, _fp32_readable(), strict=True))
    except (AttributeError, RuntimeError, TypeError):  # never seen: read each pair the slow way
        return tuple((b, o, _call(_FP32_GETTER, b, o)) for b, o in _FP32_PAIRS)


def _autocast_flags() -> tuple:
    flags = []
    for dev in ("cpu", "cuda", "mps", "xpu"):
        try:
            flags.append((dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)))
        except (TypeError, RuntimeError, AttributeError):
            pass
    return tuple(flags)


@dataclass(frozen=True)
class TorchState:
    """Every global flag that a precision experiment could leave changed."""

    default_dtype: torch.dtype
    matmul_precision: str
    cuda_matmul_allow_tf32: object
    cudnn_allow_tf32: object
    cuda_matmul_fp32_precision: object
    cudnn_fp32_precision: object
    fp32_precision: object
    autocast: tuple
    anomaly_enabled: bool
    grad_enabled: bool
    dispatch_mode_depth: int
    global_module_hooks: int
    fp32_precision_pairs: tuple = ()
    autocast_cache_enabled: object = None
    inference_mode: object = None
    anomaly_check_nan: object = None
    deterministic: object = None
    default_device: object = None
    torch_function_mode_depth: object = None
    saved_tensors_hooks: object = None  # the innermost default (pack, unpack) pair, or None
    product_kernels: tuple = ()  # see _product_kernels
    mha_fastpath: object = None


def _global_module_hooks() -> int:
    from torch.nn.modules import module as m

    names = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
             "_global_backward_pre_hooks", "_global_module_registration_hooks",
             "_global_buffer_registration_hooks", "_global_parameter_registration_hooks")
    return sum(len(getattr(m, n, {})) for n in names)


def torch_state() -> TorchState:
    """Read the current global torch state."""
    return TorchState(
        default_dtype=torch.get_default_dtype(),
        matmul_precision=_call("get_float32_matmul_precision"),
        cuda_matmul_allow_tf32=_get(torch.backends.cuda.matmul, "allow_tf32"),
        cudnn_allow_tf32=_get(torch.backends.cudnn, "allow_tf32"),
        cuda_matmul_fp32_precision=_get(torch.backends.cuda.matmul, "fp32_precision"),
        cudnn_fp32_precision=_get(torch.backends.cudnn, "fp32_precision"),
        fp32_precision=_get(torch.backends, "fp32_precision"),
        autocast=_autocast_flags(),
        anomaly_enabled=torch.is_anomaly_enabled(),
        grad_enabled=torch.is_grad_enabled(),
        dispatch_mode_depth=_dispatch_mode_depth(),
        global_module_hooks=_global_module_hooks(),
        fp32_precision_pairs=_fp32_precision_pairs(),
        autocast_cache_enabled=_call("is_autocast_cache_enabled"),
        inference_mode=_call("is_inference_mode_enabled"),
        anomaly_check_nan=_call("is_anomaly_check_nan_enabled"),
        deterministic=(_call("are_deterministic_algorithms_enabled"),
                       _call("is_deterministic_algorithms_warn_only_enabled")),
        default_device=_call("get_default_device"),
        torch_function_mode_depth=_call("_C._len_torch_function_stack"),
        saved_tensors_hooks=_call("_C._autograd._top_saved_tensors_default_hooks", False),
        product_kernels=_product_kernels(),
        mha_fastpath=_call("backends.mha.get_fastpath_enabled"),
    )


@dataclass(frozen=True, eq=False)
class Globals:
    """The global torch state a safety net puts back: default dtype, every TF32 flag, grad
    mode, ampnb's kernel overrides and the dispatch-mode stack."""

    dtype: torch.dtype
    tf32: Any  # ampnb.device's TF32State
    grad: bool
    depth: int  # dispatch modes on the stack
    overrides: int  # ampnb's kernel overrides entered

    @classmethod
    def take(cls) -> Globals:
        # imported here: `import ampnb.putback_state` (every test's before/after check) stays light
        from ampnb._kernels import live_overrides
        from ampnb.device import tf32_state

        return cls(torch.get_default_dtype(), tf32_state(), torch.is_grad_enabled(),
                   len(_dispatch_stack()), live_overrides())

    def restore(self) -> None:
        """Everything as taken: what an interrupt inside torch's own set-up could leave."""
        from ampnb._kernels import drop_overrides
        from ampnb.device import restore_tf32

        torch.set_default_dtype(self.dtype)
        restore_tf32(self.tf32)
        torch.set_grad_enabled(self.grad)
        drop_overrides(keep=self.overrides)  # overrides never handed back (their modes, on old torch)
        while len(_dispatch_stack()) > self.depth:  # a dispatch mode pushed but never popped
            _pop_mode()


def _pop_mode() -> None:
    from torch.utils._python_dispatch import _pop_mode

    _pop_mode()


def globals_kept() -> Guard:
    """`with globals_kept():` the safety net under with-blocks: `Globals` put back on the way out."""
    return Guard(Globals.take, Globals.restore)


@dataclass
class DefaultDtype:
    """The default dtype on entry, and the one the body left (None until it ends)."""

    before: torch.dtype
    left: torch.dtype | None = None


def _dtype_back(kept: DefaultDtype) -> None:
    kept.left = torch.get_default_dtype()
    torch.set_default_dtype(kept.before)


def default_dtype_kept() -> Guard:
    """`with default_dtype_kept() as kept:` the default dtype put back on the way out, whatever
    the body set; `kept.left` says what that was."""
    return Guard(lambda: DefaultDtype(torch.get_default_dtype()), _dtype_back)
