"""The one way ampnb changes how some aten ops compute: their kernels overridden for a block.

fp16 emulation (fp32 kernels on fp16 inputs) and TF32 emulation (factors rounded to TF32) both
change a handful of products and nothing else. Overriding those ops' kernels (torch.library)
keeps every other op in C++; a Python dispatch mode would cost a Python call per op, which on
a small model's ~650 ops a step is as slow as the arithmetic. Each override calls torch's own
kernel (`torch.library.get_kernel`), and the previous kernels are back on exit. torch < 2.9
has no `get_kernel`: there the same overrides run through a dispatch mode (slower, same results).
"""

from __future__ import annotations

import functools
import sys
import threading
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_GET_KERNEL = hasattr(torch.library, "get_kernel")  # torch >= 2.9
_LOCK = threading.Lock()
_active: tuple[KernelOverride, ...] = ()  # entered and not yet exited, oldest first
# (op, key) -> the library holding ampnb's one override of it; the pairs one block adds share a
# library (one registration per block, not per op), dropped when no entered block needs any of them
_registered: dict[tuple[Any, str], torch.library.Library] = {}
_COMPUTED = getattr(torch._C, "_dispatch_get_computed_kernel_for_dispatch_key", None)
_DISPATCH_KEYS: dict[str, Any] = {}  # "CPU" -> torch._C.DispatchKey.CPU, looked up once


def current_kernel(op: Any, key: str) -> Any:
    """The kernel torch runs now for (op, key): `torch.library.get_kernel`, without its per-call
    lookups (a dispatch-key table built on every call) where torch's own reader is there."""
    if _COMPUTED is None:
        return torch.library.get_kernel(op, key)
    found = _DISPATCH_KEYS.get(key)
    if found is None:
        found = _DISPATCH_KEYS[key] = torch._C.DispatchKey.__members__[key]
    return _COMPUTED(_name(op), found)


def _name(op: Any) -> str:
    """'aten::mm' for aten.mm.default, 'aten::add.Tensor' for aten.add.Tensor; a name as it is."""
    return op._name if isinstance(op, torch._ops.OpOverload) else op


def _device_keys(keys: Iterable[str]) -> tuple[str, ...]:
    """The dispatch keys this build can run (CUDA only where a GPU is there)."""
    return tuple(k for k in keys if k != "CUDA" or torch.cuda.is_available())


class KernelOverride:
    """`with KernelOverride(ops, keys):` each op's kernel on those keys runs through `run`.

    Subclasses define `run(op, call, args, kwargs)`; `call(*args, **kwargs)` runs the kernel
    below (torch's own, or an older override's `run`). `overridden` counts the calls that
    `run` changed (subclasses add to it). The override is process-wide while entered, as
    torch's kernels are; blocks may end in any order (threads, generators).
    """

    def __init__(self, ops: Iterable[Any], keys: Iterable[str] = ("CPU",)) -> None:
        self.ops, self.keys = frozenset(ops), _device_keys(keys)
        self.overridden = 0
        self._mode: _Mode | None = None  # torch < 2.9 only

    def run(self, op: Any, call: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        return call(*args, **kwargs)

    def __enter__(self) -> KernelOverride:
        global _active
        with _LOCK:
            if self in _active:
                raise RuntimeError(f"this {type(self).__name__} is already entered; make a new "
                                   "one to nest")
            if not _GET_KERNEL:
                mode = _Mode(self)
                mode.__enter__()
                self._mode = mode
            else:
                new = [(op, key) for key in self.keys for op in self.ops
                       if (op, key) not in _registered]
                if new:
                    lib = _register(new)  # all or none
                    _registered.update(dict.fromkeys(new, lib))
            _active = (*_active, self)
        return self

    def __exit__(self, *exc: object) -> None:
        global _active
        with _LOCK:
            if self in _active:
                _active = tuple(o for o in _active if o is not self)
                mode, self._mode = self._mode, None
                if mode is not None:
                    mode.__exit__(None, None, None)
                _unregister_unused()  # the previous kernels are back where none needs ours


def _register(pairs: list[tuple[Any, str]]) -> torch.library.Library:
    """ampnb's one override of each (op, key), in one library: torch's kernel wrapped by every
    active override."""
    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():  # torch warns once that aten kernels are overridden
            warnings.filterwarnings("ignore", message="Warning only once for all operators")
            for op, key in pairs:
                lib.impl(_name(op), _kernel(op, key), key, with_keyset=True)
    except BaseException:
        lib._destroy()
        raise
    return lib


def _kernel(op: Any, key: str) -> Callable[..., Any]:
    boxed = current_kernel(op, key).call_boxed  # torch's kernel, or an override made before ours

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            return boxed(keyset, *a, **k)
        for override in _active:  # the oldest is innermost, as nested blocks would be
            if op in override.ops and key in override.keys:
                call = functools.partial(_step, override, op, call)
        return call(*args, **kwargs)

    return kernel


def _step(override: KernelOverride, op: Any, call: Callable[..., Any], /, *args: Any,
          **kwargs: Any) -> Any:
    return override.run(op, call, args, kwargs)


class _Mode(TorchDispatchMode):
    """The same override as a dispatch mode, for torch < 2.9 (a Python call per op)."""

    def __init__(self, override: KernelOverride) -> None:
        super().__init__()
        self.override = override

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # nothing is compiled here: skip torch's per-op _disable_dynamo wrapper

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        o = self.override
        if func in o.ops and _key(args) in o.keys:
            return o.run(func, func, tuple(args), kwargs)
        return func(*args, **kwargs)


def _key(args: Any) -> str:
    """The backend dispatch key of an op's first tensor argument ("CPU", "CUDA"...)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device.type.upper()
    return ""


def _unregister_unused() -> None:
    """Destroy each library none of whose overrides an entered block needs (its pairs' kernels
    are torch's again); with blocks entered and left in order, that is every unneeded pair."""
    needed = {(op, key) for o in _active for key in o.keys for op in o.ops}
    kept = {id(lib) for pair, lib in _registered.items() if pair in needed}
    unused = {id(lib): lib for lib in _registered.values() if id(lib) not in kept}
    for pair in [p for p, lib in _registered.items() if id(lib) in unused]:
        del _registered[pair]
    for lib in unused.values():
        lib._destroy()


def live_overrides() -> int:
    """How many kernel overrides are entered now (0 outside every ampnb block)."""
    return len(_active)


def drop_overrides(keep: int = 0) -> None:
    """Exit the newest overrides until `keep` are left: the safety net after a block an
    interrupt cut short."""
    while len(_active) > keep:
        _active[-1].__exit__(None, None, None)


def _override_files() -> frozenset[str]:
    """The source files whose frames run an override's kernel (the mechanism and its users)."""
    return frozenset(getattr(sys.modules.get(o.__module__), "__file__", None) or ""
                     for o in (KernelOverride, *KernelOverride.__subclasses__())) | {__file__}


def without_override_frames(error: BaseException) -> BaseException:
    """error with the override's frames cut from the end of its traceback, so that a shape error
    in the user's matmul ends at the user's line (or torch's), as it does without ampnb."""
    files = _override_files()
    last_kept, tb = None, error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename not in files:
            last_kept = tb
        tb = tb.tb_next
    if last_kept is not None and last_kept.tb_next is not None:
        last_kept.tb_next = None  # everything after it is the override's own frames
    return error
