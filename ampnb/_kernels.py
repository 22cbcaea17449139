"""The one way ampnb changes how some aten ops compute: their kernels overridden for a block.

fp16 emulation (fp32 kernels on fp16 inputs) and TF32 emulation (factors rounded to TF32) both
change a handful of products and nothing else. Overriding those ops' kernels (torch.library)
keeps every other op in C++; a Python dispatch mode would cost a Python call per op, which on
a small model's ~650 ops a step is as slow as the arithmetic. Each override calls torch's own
kernel (`torch.library.get_kernel`), and the previous kernels are back on exit.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

_LIVE: list[KernelOverride] = []  # entered and not yet exited, oldest first


def _device_keys(keys: Iterable[str]) -> tuple[str, ...]:
    """The dispatch keys this build can run (CUDA only where a GPU is there)."""
    return tuple(k for k in keys if k != "CUDA" or torch.cuda.is_available())


class KernelOverride:
    """`with KernelOverride(ops, keys):` each op's kernel on those keys runs through `run`.

    Subclasses define `run(op, call, args, kwargs)`; `call(*args, **kwargs)` is torch's own
    kernel. `overridden` counts the calls that `run` changed (subclasses add to it).
    """

    def __init__(self, ops: Iterable[Any], keys: Iterable[str] = ("CPU",)) -> None:
        self.ops, self.keys = tuple(ops), _device_keys(keys)
        self.overridden = 0
        self._lib: torch.library.Library | None = None

    def run(self, op: Any, call: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        return call(*args, **kwargs)

    def __enter__(self) -> KernelOverride:
        if self._lib is not None:
            raise RuntimeError(f"this {type(self).__name__} is already entered; make a new one to nest")
        lib = torch.library.Library("aten", "IMPL")
        try:
            with warnings.catch_warnings():  # torch warns once that aten kernels are overridden
                warnings.filterwarnings("ignore", message="Warning only once for all operators")
                for key in self.keys:
                    for op in self.ops:
                        lib.impl(op, self._kernel(op, torch.library.get_kernel(op, key)), key,
                                 with_keyset=True)
        except BaseException:
            lib._destroy()
            raise
        self._lib = lib
        _LIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        lib, self._lib = self._lib, None
        if lib is not None:
            _LIVE.remove(self)
            lib._destroy()  # the previous kernels are back

    def _kernel(self, op: Any, original: Any) -> Callable[..., Any]:
        boxed = original.call_boxed

        def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
            return self.run(op, lambda *a, **k: boxed(keyset, *a, **k), args, kwargs)

        return kernel


def live_overrides() -> int:
    """How many kernel overrides are entered now (0 outside every ampnb block)."""
    return len(_LIVE)


def drop_overrides(keep: int = 0) -> None:
    """Exit the newest overrides until `keep` are left: the safety net after a block an
    interrupt cut short."""
    while len(_LIVE) > keep:
        _LIVE[-1].__exit__(None, None, None)
