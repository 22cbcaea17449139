"""TF32: the one setting type, the flags (legacy and new) set and restored exactly, and emulation."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch

from ampnb._interrupt import Guard, deferred
from ampnb._kernels import KernelOverride
from ampnb.device.hardware import AMPERE_CC, DeviceInfo, devices, get_device
from ampnb.formats import quantize


class TF32Setting(StrEnum):
    """What to do with TF32 for a run: allow it, forbid it, or emulate it by rounding inputs."""

    on = "on"
    off = "off"
    emulate = "emulate"


TF32_ALLOWED = "True, False, 'on', 'off', 'emulate' or None (as is)"


def tf32_setting(value: object) -> TF32Setting | None:
    """The TF32Setting a spelling means (True/False/'on'/'off'/'emulate'); None stays None."""
    if value is None:
        return None
    if isinstance(value, bool):
        return TF32Setting.on if value else TF32Setting.off
    if isinstance(value, str) and value in TF32Setting._value2member_map_:
        return TF32Setting(value)
    raise ValueError(f"unknown TF32 setting {value!r}; allowed: {TF32_ALLOWED}")


# torch >= 2.9 keeps two sets of books: the legacy fields (float32 matmul precision, cuDNN's
# allow_tf32) and per-(backend, op) `fp32_precision` strings. Its getters raise once the two
# disagree, so every write below keeps them in step and restore puts back both, raw.

_FP32_PAIRS = (("generic", "all"), ("cuda", "all"), ("mkldnn", "all"), ("cuda", "matmul"),
               ("cuda", "conv"), ("cuda", "rnn"), ("mkldnn", "matmul"), ("mkldnn", "conv"),
               ("mkldnn", "rnn"))  # "all" first: setting it overwrites that backend's ops
_get_raw = getattr(torch._C, "_get_fp32_precision_getter", None)
_set_raw = getattr(torch._C, "_set_fp32_precision_setter", None)


@dataclass(frozen=True)
class TF32State:
    """Every TF32-related torch flag, legacy and new, exactly as stored."""

    matmul_precision: str                          # torch.get_float32_matmul_precision()
    cudnn_allow_tf32: bool                         # torch.backends.cudnn.allow_tf32
    fp32_precision: tuple[tuple[str, str, str], ...] = ()  # (backend, op, value), torch >= 2.9

    @property
    def matmul(self) -> bool:
        """Whether CUDA fp32 matmuls may use TF32."""
        raw = {(b, o): v for b, o, v in self.fp32_precision}
        for key in (("cuda", "matmul"), ("cuda", "all"), ("generic", "all")):
            if raw.get(key, "none") != "none":
                return raw[key] == "tf32"
        return self.matmul_precision != "highest"


def _raw_pairs() -> tuple[tuple[str, str, str], ...]:
    if _get_raw is None:
        return ()
    found = []
    for backend, op in _FP32_PAIRS:
        with contextlib.suppress(RuntimeError):  # a pair this torch does not know
            found.append((backend, op, _get_raw(backend, op)))
    return tuple(found)


def _raw_write(values: dict[tuple[str, str], str]) -> dict[tuple[str, str], str]:
    """Set some fp32_precision pairs; return what they were (all put back if a write fails)."""
    saved = {k: _get_raw(*k) for k in values}
    try:
        for k, v in values.items():
            _set_raw(*k, v)
    except BaseException:
        _raw_restore(saved)
        raise
    return saved


def _raw_restore(saved: dict[tuple[str, str], str]) -> None:
    for k, v in saved.items():
        _set_raw(*k, v)


def _raw_set(values: dict[tuple[str, str], str]) -> Guard:
    """Set some fp32_precision pairs for a moment, to read a legacy field past torch's check."""
    return Guard(lambda: _raw_write(values), _raw_restore)


def _legacy_matmul_precision() -> str:
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:  # mixed APIs: neutral matmul entries make torch's consistency check pass
        with _raw_set({("cuda", "matmul"): "ieee", ("mkldnn", "matmul"): "ieee"}):
            return torch.get_float32_matmul_precision()


def _legacy_cudnn_tf32() -> bool:
    try:
        return bool(torch.backends.cudnn.allow_tf32)
    except RuntimeError:  # the check passes with conv = rnn = tf32 exactly when the field is True
        with _raw_set({("cuda", "conv"): "tf32", ("cuda", "rnn"): "tf32"}):
            try:
                return bool(torch.backends.cudnn.allow_tf32)
            except RuntimeError:
                return False


def tf32_state() -> TF32State:
    """Read every TF32 flag without changing any."""
    return TF32State(_legacy_matmul_precision(), _legacy_cudnn_tf32(), _raw_pairs())


def restore_tf32(state: TF32State) -> None:
    """Put every TF32 flag back exactly as `state` recorded it (an interrupt cannot cut it short)."""
    if not isinstance(state, TF32State):
        raise ValueError(f"restore_tf32 needs a TF32State (from tf32_state or set_tf32), got {state!r}")
    with deferred():
        # The legacy setters also write fp32_precision entries, so the raw entries go last.
        torch.set_float32_matmul_precision(state.matmul_precision)
        torch.backends.cudnn.allow_tf32 = state.cudnn_allow_tf32
        for backend, op, value in state.fp32_precision:
            _set_raw(backend, op, value)


def _check_enabled(enabled: object) -> None:
    if not isinstance(enabled, bool):
        raise ValueError(f"set_tf32 takes True or False, got {enabled!r}")


def _switch(enabled: bool) -> TF32State:
    """Write every flag for `enabled`; return the state before (restored if a write fails)."""
    previous = tf32_state()
    try:
        if enabled:
            if previous.matmul_precision == "highest":
                torch.backends.cuda.matmul.allow_tf32 = True  # -> "high" on CUDA only
            if _set_raw is not None:
                _set_raw("cuda", "matmul", "tf32")
        else:
            torch.set_float32_matmul_precision("highest")
        torch.backends.cudnn.allow_tf32 = enabled
        if _set_raw is not None:  # explicit, so a backend-wide "all" entry cannot override it
            for op in ("conv", "rnn"):
                _set_raw("cuda", op, "tf32" if enabled else "ieee")
    except BaseException:
        restore_tf32(previous)
        raise
    return previous


def set_tf32(enabled: bool) -> TF32State:
    """Allow (or forbid) TF32 in CUDA fp32 matmuls and cuDNN convolutions; return the old state."""
    _check_enabled(enabled)
    if enabled:
        _say_if_nothing_changes("ampnb.set_tf32(True)")
    # Only the Guard's enter: the switch completes, or an interrupt during it is undone.
    return Guard(lambda: _switch(enabled), restore_tf32).apply()


def _switch_guard(enabled: bool, then: Callable[[], Any] = lambda: None,
                  undo: Callable[[Any], None] = lambda _: None) -> Guard:
    """Switch TF32, then enter `then`; the `as` value is then()'s; exit undoes both, whole.

    A Guard (not a generator) so that no line of ours runs between the body and the restore.
    """
    saved: list[tuple[TF32State, Any]] = []

    def enter() -> Any:
        previous = _switch(enabled)
        try:
            entered = then()
        except BaseException:
            restore_tf32(previous)
            raise
        saved.append((previous, entered))
        return entered

    def exit(_: object) -> None:
        previous, entered = saved.pop()
        try:
            undo(entered)
        finally:
            restore_tf32(previous)

    return Guard(enter, exit)


def tf32(enabled: bool) -> Guard:
    """TF32 on or off for the body (`as`: the state inside); restored after, also on error or interrupt."""
    _check_enabled(enabled)
    if enabled:
        _say_if_nothing_changes("ampnb.tf32(True) (restored after the block)")
    return _switch_guard(enabled, tf32_state)


def _no_effect(dev: DeviceInfo) -> str | None:
    """Why the TF32 switch changes nothing on a device; None where TF32 is real."""
    if dev.type != "cuda":
        return (f"TF32 has no effect on {dev.name}: it is a CUDA tensor-core mode (Ampere+, "
                f"compute capability >= 8.0); fp32 matmuls here stay full fp32")
    if dev.capability < AMPERE_CC:
        cc = ".".join(map(str, dev.capability))
        return f"TF32 has no effect on {dev.name} ({dev.label}, compute capability {cc} < 8.0)"
    return None


def tf32_effect(device: str | torch.device | DeviceInfo = "cpu") -> str:
    """What the TF32 switch does on a device, in one sentence."""
    dev = get_device(device)
    now = "on" if tf32_state().matmul else "off"
    nothing = _no_effect(dev)
    if nothing is not None:
        return nothing if dev.type == "cuda" else f"{nothing} (switch: {now})"
    cc = ".".join(map(str, dev.capability))
    return (f"TF32 is {now} for fp32 matmuls on {dev.name} ({dev.label}, compute capability "
            f"{cc}): 10-bit mantissa inputs, fp32 range and accumulation")


def _say_if_nothing_changes(call: str) -> None:
    """Warn (as torch's autocast does for an absent device) when no device here has TF32 units."""
    present = devices()
    cuda = [d for d in present if d.type == "cuda"] or present[:1]
    reasons = [_no_effect(d) for d in cuda]
    if all(reasons):
        warnings.warn(f"{call}: {reasons[0]}; the flags are set all the same", UserWarning,
                      stacklevel=3)


# ---------------------------------------------------------------- emulation

aten = torch.ops.aten
# Which arguments of each op are the factors of a product that TF32 tensor cores would
# round (a bias added afterwards is not rounded). Composite ops (matmul, linear) reach these.
_FACTORS: dict[object, tuple[int, ...]] = {
    aten.mm.default: (0, 1),
    aten.bmm.default: (0, 1),
    aten.addmm.default: (1, 2),
    aten.baddbmm.default: (1, 2),
    aten.addbmm.default: (1, 2),
    aten.convolution.default: (0, 1),
    aten.convolution_backward.default: (0, 1, 2),
}


def _round(x: object) -> object:
    if isinstance(x, torch.Tensor) and x.dtype == torch.float32:
        return quantize(x, "tf32")
    return x


class TF32Emulation(KernelOverride):
    """Round the fp32 factors of every matmul and convolution to TF32 before it runs."""

    def __init__(self) -> None:
        super().__init__(_FACTORS, ("CPU", "CUDA"))

    @property
    def rounded_ops(self) -> int:
        """How many products had their factors rounded."""
        return self.overridden

    def run(self, op: Any, call: Any, args: tuple, kwargs: dict) -> Any:
        which = _FACTORS[op]
        self.overridden += 1
        return call(*(_round(a) if i in which else a for i, a in enumerate(args)), **kwargs)


def tf32_context(setting: object,
                 device: str | torch.device = "cpu") -> contextlib.AbstractContextManager:
    """Apply a TF32 setting (see `tf32_setting`; None = as is) for the body; restore it.

    The `as` value is the emulation (it counts the ops it rounded) for 'emulate', else None.
    """
    chosen = tf32_setting(setting)
    if chosen is None:
        return contextlib.nullcontext()
    if chosen is TF32Setting.emulate:
        # Real TF32 under the emulation would round twice, so emulation runs with TF32 off.
        return _switch_guard(False, lambda: TF32Emulation().__enter__(),
                             lambda mode: mode.__exit__(None, None, None))
    return _switch_guard(chosen is TF32Setting.on)
