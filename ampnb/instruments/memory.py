"""Memory meter: bytes saved for backward, parameter / gradient / optimizer-state bytes, CUDA peak."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampnb.display import Table
from ampnb.modes import get_mode

DEFAULT_MODES = ("32-true", "bf16-mixed", "bf16-true")


def format_bytes(n: int | None) -> str:
    """1536 -> '1.5 KiB'; exact bytes below 1 KiB."""
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _storage(t: torch.Tensor) -> tuple[Any, int]:
    """(key, bytes) of the memory block a tensor holds; views of one block count once."""
    try:
        s = t.untyped_storage()
        return (t.device, s.data_ptr()), s.nbytes()
    except (RuntimeError, NotImplementedError):  # sparse / storage-less tensors
        return id(t), t.numel() * t.element_size()


class _Saved:
    """What the pack hook returns: the tensor, and a release of its bytes when autograd drops it."""

    __slots__ = ("meter", "key", "tensor")

    def __init__(self, meter: MemoryMeter, key: Any, tensor: torch.Tensor) -> None:
        self.meter, self.key, self.tensor = meter, key, tensor

    def __del__(self) -> None:
        self.meter._release(self.key)


class MemoryMeter:
    """`with memory_meter() as m:` tracks live bytes saved for backward (peak), and CUDA's peak."""

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self.live = self.peak_bytes = self.tensors = 0
        self.cuda_peak_bytes: int | None = None
        self._refs: dict[Any, list[int]] = {}  # storage key -> [references, bytes]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._cuda_start = 0

    def _on_cuda(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_available()

    def __enter__(self) -> MemoryMeter:
        if self._on_cuda():
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._cuda_start = torch.cuda.memory_allocated(self.device)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
        if self._on_cuda():
            torch.cuda.synchronize(self.device)
            self.cuda_peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._cuda_start

    def _pack(self, t: torch.Tensor) -> Any:
        base = t._base if t._is_view() else t  # weight.t() is saved as a view of the weight
        if isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad):
            return t  # parameters are held anyway: saving them costs nothing extra
        key, nbytes = _storage(t)
        ref = self._refs.setdefault(key, [0, nbytes])
        if ref[0] == 0:
            self.live += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live)
        ref[0] += 1
        self.tensors += 1
        return _Saved(self, key, t)

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: Any) -> None:
        ref = self._refs.get(key)
        if ref is None:
            return
        ref[0] -= 1
        if ref[0] == 0:
            self.live -= ref[1]
            del self._refs[key]

    def table(self) -> Table:
        """Peak bytes saved for backward (and CUDA's peak) while the meter was on."""
        rows = [("saved for backward (peak)", format_bytes(self.peak_bytes)),
                ("tensors saved", self.tensors)]
        if self.cuda_peak_bytes is not None:
            rows.append(("CUDA peak allocated (above start)", format_bytes(self.cuda_peak_bytes)))
        return Table(("memory", "measured"), rows, caption=f"memory on {self.device}",
                     notes=("parameters saved for backward are not counted: they exist anyway",))

    def _repr_html_(self) -> str:
        return self.table()._repr_html_()

    def __repr__(self) -> str:
        return repr(self.table())


def memory_meter(device: str | torch.device = "cpu") -> MemoryMeter:
    """`with memory_meter() as m:` measures activation memory saved for backward."""
    return MemoryMeter(device)


@dataclass(frozen=True)
class MemoryStats:
    """Bytes one training step holds under one mode."""

    mode: str
    saved_bytes: int
    saved_tensors: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    cuda_peak_bytes: int | None = None

    @property
    def total(self) -> int:
        """Saved activations + parameters + gradients + optimizer state."""
        return self.saved_bytes + self.param_bytes + self.grad_bytes + self.optimizer_bytes


def _nbytes(ts: Iterable[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


def _unpack_demo(model: Any, inputs: Any, targets: Any, loss_fn: Any, optimizer: Any) -> tuple:
    """A Demo gives its model, first batch, loss and optimizer class with its settings."""
    if all(hasattr(model, k) for k in ("model", "optimizer", "loss_fn", "batches")):
        opt = model.optimizer
        accepted = inspect.signature(type(opt)).parameters  # defaults may hold internal keys
        settings = {k: v for k, v in opt.defaults.items() if k in accepted}
        x, y = model.batches[0]
        return (model.model, x if inputs is None else inputs, y if targets is None else targets,
                loss_fn or model.loss_fn,
                optimizer or (lambda ps: type(opt)(ps, **settings)))
    return model, inputs, targets, loss_fn, optimizer


def measure_memory(model: nn.Module, inputs: Any = None, targets: Any = None,
                   loss_fn: Callable | None = None, mode: Any = "32-true",
                   optimizer: Callable | None = None, device: str | None = None) -> MemoryStats:
    """One step (forward, loss, backward, optimizer step) on a deep copy, under `mode`."""
    model, inputs, targets, loss_fn, optimizer = _unpack_demo(model, inputs, targets, loss_fn,
                                                              optimizer)
    if not isinstance(model, nn.Module):
        raise ValueError(f"measure_memory needs an nn.Module or a Demo, got {type(model).__name__}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"{type(model).__name__} has no trainable parameters; "
                         "memory_meter() measures its activations alone")
    if inputs is None:
        raise ValueError("measure_memory needs inputs (a batch), or a Demo that has batches")
    m = get_mode(mode)
    dev = device or next(model.parameters()).device.type
    m.check(dev)
    with torch.random.fork_rng(devices=[]):  # dropout in the copy must not move the user's RNG
        net = m.convert_module(copy.deepcopy(model)).to(dev)
        opt = (optimizer or torch.optim.AdamW)([p for p in net.parameters() if p.requires_grad])
        x = m.convert_input(_to(inputs, dev))
        with MemoryMeter(dev) as meter:
            with m.forward_context(dev):
                out = net(x)
                loss = loss_fn(out, _to(targets, dev)) if loss_fn else out.float().mean()
            loss.float().backward()
        opt.step()
    params = list(net.parameters())
    return MemoryStats(m.name, meter.peak_bytes, meter.tensors, _nbytes(params),
                       _nbytes(p.grad for p in params),
                       _nbytes(v for st in opt.state.values() for v in st.values()),
                       meter.cuda_peak_bytes)


def _to(data: Any, device: str) -> Any:
    if isinstance(data, torch.Tensor):
        return data.to(device)
    if isinstance(data, (list, tuple)):
        return type(data)(_to(d, device) for d in data)
    return data


@dataclass(frozen=True)
class MemoryReport:
    """Memory of one step under several modes, side by side."""

    stats: tuple[MemoryStats, ...]

    def table(self) -> Table:
        """One row per mode; ratios are against the first mode."""
        base = self.stats[0]
        cuda = any(s.cuda_peak_bytes is not None for s in self.stats)
        rows = []
        for s in self.stats:
            ratio = f"{s.saved_bytes / base.saved_bytes:.2f}x" if base.saved_bytes else "-"
            rows.append((s.mode, format_bytes(s.saved_bytes), ratio, format_bytes(s.param_bytes),
                         format_bytes(s.grad_bytes), format_bytes(s.optimizer_bytes),
                         format_bytes(s.total), *((format_bytes(s.cuda_peak_bytes),) if cuda else ())))
        return Table(("mode", "saved for backward", f"vs {base.mode}", "parameters", "gradients",
                      "optimizer state", "total", *(("CUDA peak",) if cuda else ())), rows,
                     caption="memory of one training step (same model and batch)",
                     notes=("saved for backward: peak bytes autograd held for the backward pass "
                            "(parameters excluded; autocast's low-precision weight copies "
                            "included)",))

    def _repr_html_(self) -> str:
        return self.table()._repr_html_()

    def __repr__(self) -> str:
        return repr(self.table())


def memory_report(model: nn.Module, inputs: Any = None, targets: Any = None,
                  loss_fn: Callable | None = None, modes: Iterable[Any] = DEFAULT_MODES,
                  optimizer: Callable | None = None, device: str | None = None) -> MemoryReport:
    """measure_memory under each mode on the same model and batch (32-true, bf16-mixed, bf16-true)."""
    modes = tuple(modes)
    if not modes:
        raise ValueError("memory_report needs at least one mode, e.g. ('32-true', 'bf16-mixed')")
    return MemoryReport(tuple(measure_memory(model, inputs, targets, loss_fn, m, optimizer, device)
                              for m in modes))
