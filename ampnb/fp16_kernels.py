"""fp16 matrix products on a CPU without fp16 units, computed as fp32-accumulating tensor cores do.

A GPU's tensor cores multiply fp16 inputs exactly and accumulate in fp32, rounding the result
to fp16 once. A CPU can compute exactly that with an fp32 kernel on the fp16-valued inputs,
at fp32 speed, where torch's own fp16 CPU kernels are a slow fallback (or, for oneDNN's LSTM,
fail). Everything else — autocast's casts, elementwise ops, the GradScaler — stays real fp16.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from enum import StrEnum
from typing import Any

import torch

from ampnb._interrupt import Guard
from ampnb._kernels import KernelOverride
from ampnb._tree import map_tensors
from ampnb.cpu import cpu_native
from ampnb.putback import generator

aten = torch.ops.aten
HALF = torch.float16

# Products (and the kernels built on them) whose fp16 results are computed in fp32 and rounded
# once; forward and backward. Only functional overloads: out=/in-place ones run natively.
EMULATED = frozenset({
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
    aten.addbmm.default, aten.mv.default, aten.addmv.default, aten.dot.default,
    aten.convolution.default, aten.convolution_backward.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten.mkldnn_rnn_layer.default, aten.mkldnn_rnn_layer_backward.default,
})


def _widen(a: Any) -> Any:
    """a with its fp16 tensors (also inside a list of them) as fp32; the op's arguments are flat."""
    if isinstance(a, torch.Tensor):
        return a.float() if a.dtype == HALF else a
    if isinstance(a, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in a):
        return type(a)(_widen(t) for t in a)
    return a


def _dtypes(args: Any) -> Iterator[torch.dtype]:
    """The dtypes of the tensors among the arguments, in order (into lists of tensors too)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a.dtype
        elif isinstance(a, (list, tuple)):
            yield from _dtypes(a)


def _meta(t: Any) -> Any:
    return t.to("meta") if isinstance(t, torch.Tensor) else t


def _has_half(args: Any) -> bool:
    """Whether any tensor among the arguments (or in a list of them, as RNN weights come) is fp16."""
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.dtype == HALF:
                return True
        elif isinstance(a, (list, tuple)) and a and _has_half(a):
            return True
    return False


class Fp16KernelEmulation(KernelOverride):
    """`with Fp16KernelEmulation():` fp16 matmuls/convolutions/attention/RNNs run as fp32 kernels.

    Only the emulated ops' CPU kernels are overridden (`ampnb._kernels`): torch's own kernel
    runs, on widened inputs where one is fp16, and its results are rounded once.
    """

    def __init__(self) -> None:
        super().__init__(EMULATED, ("CPU",))

    @property
    def emulated_ops(self) -> int:
        """How many calls ran emulated (had an fp16 input)."""
        return self.overridden

    def run(self, op: Any, call: Any, args: tuple, kwargs: dict) -> Any:
        if not (_has_half(args) or _has_half(kwargs.values())):
            return call(*args, **kwargs)
        wanted = _out_dtypes(op, args, kwargs)
        out = call(*map(_widen, args), **{k: _widen(v) for k, v in kwargs.items()})
        self.overridden += 1
        if isinstance(out, torch.Tensor):
            return _narrow(out, wanted[0] if wanted else None)
        return type(out)(_narrow(t, wanted[i] if i < len(wanted) else None)
                         for i, t in enumerate(out))


_OUT_DTYPES: dict[tuple, tuple[torch.dtype | None, ...]] = {}


# Products whose one output has their inputs' dtype: all-fp16 inputs give fp16, known without a
# meta kernel (the first meta call of a decomposed op imports torch's compiler: seconds).
_SAME_DTYPE = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default,
                         aten.baddbmm.default, aten.addbmm.default, aten.mv.default,
                         aten.addmv.default, aten.dot.default})


def _out_dtypes(op: Any, args: Any, kwargs: Any) -> tuple[torch.dtype | None, ...]:
    """The dtypes the native kernel would return, per output (from its meta kernel, cached per
    input dtypes); None for an output that is None."""
    key = (op, *_dtypes(args), *_dtypes(kwargs.values()))
    if op in _SAME_DTYPE and all(d == HALF for d in key[1:]):
        return (HALF,)
    found = _OUT_DTYPES.get(key)
    if found is None:
        try:
            out = op(*map_tensors(_meta, args), **map_tensors(_meta, kwargs))
            outs = (out,) if isinstance(out, torch.Tensor) else out
            found = tuple(t.dtype if isinstance(t, torch.Tensor) else None for t in outs)
        except Exception:  # noqa: BLE001 - no meta kernel: fp32 results become fp16
            found = ()
        _OUT_DTYPES[key] = found
    return found


def _narrow(t: Any, dtype: torch.dtype | None) -> Any:
    """An emulated kernel's output in the dtype the native one returns (fp32 → fp16 if unknown)."""
    if not isinstance(t, torch.Tensor):
        return t
    if dtype is None:
        dtype = HALF if t.dtype == torch.float32 else t.dtype
    return t.to(dtype) if t.dtype != dtype else t


def emulated_fp16_kernels(enabled: bool = True) -> contextlib.AbstractContextManager:
    """fp16 products as fp32 kernels rounded once, for the body (`as` gives the emulation, or None).

    A Guard: the kernels are overridden whole and always handed back, also on an interrupt.
    """
    if not isinstance(enabled, bool):  # 'no' is truthy: a string must not turn emulation on
        raise ValueError(f"enabled={enabled!r} is not allowed; allowed: True or False")
    if not enabled:
        return contextlib.nullcontext()
    emulation = Fp16KernelEmulation()
    return Guard(emulation.__enter__, lambda _: emulation.__exit__(None, None, None))


class Fp16Kernels(StrEnum):
    """How fp16 products run on a CPU: decided by the CPU, torch's own kernels, or emulated."""

    AUTO = "auto"          # emulated where the CPU has no fp16 units, else native
    NATIVE = "native"      # torch's fp16 CPU kernels (a slow fallback without fp16 units)
    EMULATED = "emulated"  # fp32 kernels on the fp16 inputs, rounded once (tensor-core numerics)


FP16_KERNELS_ALLOWED = tuple(k.value for k in Fp16Kernels)
_setting = [Fp16Kernels.AUTO]  # the process-wide choice (`set_fp16_kernels`)


def fp16_kernels_choice(value: str | Fp16Kernels | None = None) -> Fp16Kernels:
    """A validated choice; None means the process-wide setting."""
    if value is None:
        return _setting[0]
    try:
        return Fp16Kernels(value.strip().lower() if isinstance(value, str) else value)
    except ValueError:
        raise ValueError(f"fp16_kernels={value!r} is not allowed; allowed: "
                         f"{', '.join(FP16_KERNELS_ALLOWED)}") from None


def set_fp16_kernels(value: str | Fp16Kernels) -> Fp16Kernels:
    """Set how fp16 products run on CPUs from now on ('auto', 'native', 'emulated'); returns the old."""
    if value is None:  # None means "the process-wide setting" elsewhere: here it would set nothing
        raise ValueError(f"set_fp16_kernels(None) is not allowed; allowed: "
                         f"{', '.join(FP16_KERNELS_ALLOWED)}")
    choice, previous = fp16_kernels_choice(value), _setting[0]
    _setting[0] = choice
    return previous


def emulates_fp16(device: str | torch.device = "cpu", choice: str | Fp16Kernels | None = None) -> bool:
    """Whether fp16 products on `device` run emulated under `choice` (CUDA: never, it has the units)."""
    found = fp16_kernels_choice(choice)
    if torch.device(device).type != "cpu":
        return False
    return found is Fp16Kernels.EMULATED or (found is Fp16Kernels.AUTO and not cpu_native("fp16"))


def fp16_kernel_context(device: str | torch.device = "cpu",
                        choice: str | Fp16Kernels | None = None) -> contextlib.AbstractContextManager:
    """The context a whole fp16 step (forward, backward, update) runs in on `device` under `choice`."""
    return emulated_fp16_kernels(emulates_fp16(device, choice))


SLOWDOWN_SHAPE = (128, 256, 512)  # m, k, n: a small MLP matmul (the native fallback: ~50 ms)


def _best_seconds(run: Any, repeat: int) -> float:
    """The fastest of `repeat` timed runs: a kernel's speed, least disturbed by a busy machine."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return min(times)


@functools.cache
def native_slowdown() -> float:
    """Native fp16 CPU matmul time / emulated time here, on a SLOWDOWN_SHAPE mm (measured once)."""
    m, k, n = SLOWDOWN_SHAPE
    g = generator(0)
    a, b = torch.randn(m, k, generator=g).half(), torch.randn(k, n, generator=g).half()
    mode = Fp16KernelEmulation()

    def emulated() -> None:
        with mode:
            torch.mm(a, b)

    with torch.no_grad():
        emulated()  # warm-up: the first call registers the override and caches dtypes
        # the native fallback is slow enough (tenths of a second) that two runs time it well
        return _best_seconds(lambda: torch.mm(a, b), 2) / _best_seconds(emulated, 5)


def fp16_kernels_note(device: str | torch.device = "cpu",
                      choice: str | Fp16Kernels | None = None) -> str:
    """One line saying how fp16 products run on `device` (with the measured slowdown), '' on CUDA."""
    if torch.device(device).type != "cpu":
        return ""
    if emulates_fp16(device, choice):
        return (f"fp16 GEMMs emulated in fp32 (as tensor cores accumulate); native fp16 kernels "
                f"here are {native_slowdown():.0f}× slower")
    if cpu_native("fp16"):
        return "fp16 kernels native (this CPU has fp16 units)"
    return (f"fp16 kernels native (torch's CPU fallback, {native_slowdown():.0f}× slower than "
            "the emulated ones)")
