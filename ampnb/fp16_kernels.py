"""fp16 matrix products on a CPU without fp16 units, computed as fp32-accumulating tensor cores do.

A GPU's tensor cores multiply fp16 inputs exactly and accumulate in fp32, rounding the result
to fp16 once. A CPU can compute exactly that with an fp32 kernel on the fp16-valued inputs,
at fp32 speed, where torch's own fp16 CPU kernels are a slow fallback (or, for oneDNN's LSTM,
fail). Everything else — autocast's casts, elementwise ops, the GradScaler — stays real fp16.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ampnb._tree import map_tensors, tensors

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


def _widen(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype == HALF else t


def _meta(t: Any) -> Any:
    return t.to("meta") if isinstance(t, torch.Tensor) else t


class Fp16KernelEmulation(TorchDispatchMode):
    """`with Fp16KernelEmulation():` fp16 matmuls/convolutions/attention/RNNs run as fp32 kernels."""

    def __init__(self) -> None:
        super().__init__()
        self.emulated_ops = 0
        self._out_dtypes: dict[tuple, tuple[torch.dtype | None, ...]] = {}

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # nothing here is compiled: skip torch's costly _disable_dynamo wrapper

    def _dtypes(self, func: Any, args: Any, kwargs: Any) -> tuple[torch.dtype | None, ...]:
        """The dtypes the native kernel would return (from its meta kernel, cached per input dtypes)."""
        key = (func, *(t.dtype for t in tensors((args, kwargs))))
        if key not in self._out_dtypes:
            try:
                out = func(*map_tensors(_meta, args), **map_tensors(_meta, kwargs))
                found = tuple(t.dtype for t in tensors(out))
            except Exception:  # noqa: BLE001 - no meta kernel: fp32 results become fp16
                found = ()
            self._out_dtypes[key] = found
        return self._out_dtypes[key]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func not in EMULATED or not any(t.dtype == HALF for t in tensors((args, kwargs))):
            return func(*args, **kwargs)
        wanted = iter(self._dtypes(func, args, kwargs))
        out = func(*map_tensors(_widen, args), **map_tensors(_widen, kwargs))
        self.emulated_ops += 1

        def narrow(t: torch.Tensor) -> torch.Tensor:
            dtype = next(wanted, HALF if t.dtype == torch.float32 else t.dtype)
            return t.to(dtype) if dtype is not None and t.dtype != dtype else t

        return map_tensors(narrow, out)


@contextlib.contextmanager
def emulated_fp16_kernels(enabled: bool = True) -> Iterator[Fp16KernelEmulation | None]:
    """fp16 products as fp32 kernels rounded once, for the body (yields the mode, or None)."""
    if not enabled:
        yield None
        return
    with Fp16KernelEmulation() as mode:
        yield mode
