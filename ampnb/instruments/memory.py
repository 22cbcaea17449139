"""Memory meter: bytes saved for backward, parameter / gradient / optimizer-state bytes, CUDA peak."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampnb._interrupt import Guard, deferred
from ampnb._tree import tensors
from ampnb.apex import master_of
from ampnb.batch import as_batch, failure, model_loss, step_loss
from ampnb.device.placement import Placement, place_model
from ampnb.display import Table, TableView, dtype_name, format_bytes
from ampnb.modes import PrecisionMode, get_mode
from ampnb.precision import Precision
from ampnb.start import started
from ampnb.step import StepSettings, step_context

DEFAULT_MODES = ("32-true", "bf16-mixed", "bf16-true")


def _storage(t: torch.Tensor) -> tuple[Any, int]:
    """(key, bytes) of the memory block a tensor holds; views of one block count once."""
    try:
        s = t.untyped_storage()
        return (t.device, s.data_ptr()), s.nbytes()
    except (RuntimeError, NotImplementedError):  # sparse / storage-less tensors
        return id(t), t.numel() * t.element_size()


class _Held:
    """What the pack hook returns: autograd frees it when it drops the saved tensor."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class MemoryMeter(TableView, Guard):
    """`with memory_meter() as m:` tracks live bytes saved for backward (peak), and CUDA's peak.

    The one meter: %%amp --memory, memory_report and every Workbench step use it. No ampnb
    code runs when autograd frees a saved tensor (a KeyboardInterrupt raised in a finalizer
    is lost): the weak reference to each `_Held` has a builtin list's `append` as callback,
    and the meter settles those frees the next time it packs or is read. A Guard: the hooks
    are pushed and popped whole, and an interrupt while pushing pops them before it is raised.
    """

    def __init__(self, device: str | torch.device = "cpu") -> None:
        Guard.__init__(self, self._attach, self._detach)
        self.device = torch.device(device)
        self.peak_bytes = self.tensors = self._live = 0
        self.cuda_peak_bytes: int | None = None
        self._refs: dict[Any, list[int]] = {}  # storage key -> [holders alive, bytes]
        self._held: dict[int, tuple[weakref.ref, Any]] = {}  # id(ref) -> (ref, storage key)
        self._freed: list[weakref.ref] = []  # refs to holders autograd has freed, not settled
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._cuda_start = 0

    def _on_cuda(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_available()

    def _attach(self) -> MemoryMeter:
        if self._on_cuda():  # CUDA's peak "above start": what this block allocated at most
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._cuda_start = torch.cuda.memory_allocated(self.device)
        self._hooks.__enter__()
        return self

    def _detach(self, _: object = None) -> None:
        self._hooks.__exit__(None, None, None)
        if self._on_cuda():
            torch.cuda.synchronize(self.device)
            self.cuda_peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._cuda_start

    @property
    def live(self) -> int:
        """Bytes saved for backward that autograd holds now."""
        self._settle()
        return self._live

    def _pack(self, t: torch.Tensor) -> Any:
        base = t._base if t._is_view() else t  # weight.t() is saved as a view of the weight
        if isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad):
            return t  # parameters are held anyway: saving them costs nothing extra
        if self._freed:
            self._settle()  # frees since the last pack count before this one: a true peak
        key, nbytes = _storage(t)
        ref = self._refs.setdefault(key, [0, nbytes])
        if ref[0] == 0:
            self._live += nbytes
            self.peak_bytes = max(self.peak_bytes, self._live)
        ref[0] += 1
        self.tensors += 1
        held = _Held(t)
        weak = weakref.ref(held, self._freed.append)  # a builtin: no Python runs at the free
        self._held[id(weak)] = (weak, key)
        return held

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Held) else saved

    def _settle(self) -> None:
        """Release the bytes of the holders autograd freed since the last settle."""
        with deferred():  # a settle is done whole or not begun: counts never drift
            while self._freed:  # pop: a free on autograd's device thread may append meanwhile
                weak = self._freed.pop()
                _, key = self._held.pop(id(weak), (None, None))
                ref = self._refs.get(key)
                if ref is None:
                    continue
                ref[0] -= 1
                if ref[0] == 0:
                    self._live -= ref[1]
                    del self._refs[key]

    def table(self) -> Table:
        """Peak bytes saved for backward (and CUDA's peak) while the meter was on."""
        rows = [("saved for backward (peak)", format_bytes(self.peak_bytes)),
                ("tensors saved", self.tensors)]
        if self.cuda_peak_bytes is not None:
            rows.append(("CUDA peak allocated (above start)", format_bytes(self.cuda_peak_bytes)))
        return Table(("memory", "measured"), rows, caption=f"memory on {self.device}",
                     notes=("parameters saved for backward are not counted: they exist anyway",))


def memory_meter(device: str | torch.device = "cpu") -> MemoryMeter:
    """`with memory_meter() as m:` measures activation memory saved for backward."""
    return MemoryMeter(device)


@dataclass(frozen=True)
class MemoryStats:
    """Bytes one training step holds under one mode (all 0 and `error` said when it failed)."""

    mode: str
    saved_bytes: int
    saved_tensors: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int  # its state, and fp32 master weights where the mode keeps them
    cuda_peak_bytes: int | None = None
    error: str = ""  # why the mode's step failed: the error, where raised, the mode's dtype

    @property
    def total(self) -> int:
        """Saved activations + parameters + gradients + optimizer state."""
        return self.saved_bytes + self.param_bytes + self.grad_bytes + self.optimizer_bytes


def _nbytes(ts: Iterable[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


def _own_or_mean(out: Any, targets: Any) -> torch.Tensor:
    """The loss without a loss_fn: the model's own, else the mean of its float outputs stands
    in (it keeps the same tensors saved for backward as a real loss would)."""
    own = model_loss(out)
    if own is not None:
        return own
    floats = [t.float().mean() for t in tensors(out) if t.is_floating_point() and t.requires_grad]
    if not floats:
        step_loss(out, targets, None)  # raises: names what is allowed
    return sum(floats)


@dataclass(frozen=True)
class _Step:
    """What every mode's step gets: the model, its batch, loss, optimizer and where it runs."""

    model: nn.Module
    run: Any
    loss_fn: Callable | None
    optimizer: torch.optim.Optimizer | None
    where: Placement


def _step_of(model: Any, batch: Any, loss_fn: Callable | None,
             optimizer: torch.optim.Optimizer | None, device: Any) -> _Step:
    """The arguments checked once (ValueError naming what is allowed); the device placed."""
    if all(hasattr(model, k) for k in ("model", "optimizer", "loss_fn", "batches")):  # a Demo
        batch = model.batches[0] if batch is None else batch
        loss_fn = loss_fn or model.loss_fn
        optimizer = optimizer or model.optimizer
        model = model.model
    if not isinstance(model, nn.Module):
        raise ValueError(f"measure_memory needs an nn.Module or a Demo, got {type(model).__name__}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"{type(model).__name__} has no trainable parameters; "
                         "memory_meter() measures its activations alone")
    if batch is None:
        raise ValueError("measure_memory needs inputs (a batch), or a Demo that has batches")
    if loss_fn is not None and not callable(loss_fn):  # e.g. the old (model, x, y) call form
        raise ValueError(f"loss_fn={type(loss_fn).__name__} is not allowed; allowed: a callable "
                         f"(outputs, targets) or None, with the batch as one argument: "
                         f"memory_report(model, (inputs, targets), loss_fn).")
    run = as_batch(batch, loss_fn)
    where = place_model(model, device, also=[("the batch", batch)])
    return _Step(model, run, loss_fn, optimizer, where)


def _measure(step: _Step, m: PrecisionMode) -> MemoryStats:
    """The one training step (ampnb.step.train_step) on a fresh copy of the model, under m."""
    dev = torch.device(step.where.device)
    # A fresh copy from one snapshot; the user's RNG is put back (dropout in the copy draws).
    with started(step.model, step.optimizer) as start:
        net, opt = start.copy(m, str(dev))
        params = list(net.parameters())
        p = Precision.of(m, device=dev)
        with MemoryMeter(dev) as meter, step_context(StepSettings(p), net):
            p.step(net, opt, step.run, step.loss_fn or _own_or_mean)
    masters = [master_of(p) for p in params]  # APEX O2's fp32 masters live in the optimizer
    return MemoryStats(m.name, meter.peak_bytes, meter.tensors, _nbytes(params),
                       _nbytes(p.grad for p in params),
                       _nbytes(v for st in opt.state.values() for v in st.values())
                       + _nbytes(w for w, p in zip(masters, params) if w is not p),
                       meter.cuda_peak_bytes)


def measure_memory(model: nn.Module, batch: Any = None, loss_fn: Callable | None = None, *,
                   mode: Any = "32-true", optimizer: torch.optim.Optimizer | None = None,
                   device: str | None = None) -> MemoryStats:
    """The one training step (ampnb.step.train_step) on a deep copy, under `mode`.

    A batch is anything ampnb.batch takes; without loss_fn the model's own loss is used (or,
    when it has none, the mean of its outputs). The optimizer is an instance: a copy of it
    (type, settings, state) steps the copy's weights the mode's way, with its GradScaler.
    The device is where the model's parameters are; `device` only states it.
    """
    step = _step_of(model, batch, loss_fn, optimizer, device)
    m = get_mode(mode)
    m.check(step.where.device)
    return _measure(step, m)


def _failed(m: PrecisionMode, error: Exception) -> MemoryStats:
    dtype = dtype_name(m.compute_dtype if m.is_mixed else m.param_dtype)
    return MemoryStats(m.name, 0, 0, 0, 0, 0, None, f"{failure(error, 160)}; under {dtype}")


@dataclass(frozen=True, repr=False)  # repr from table() (TableView)
class MemoryReport(TableView):
    """Memory of one step under several modes, side by side; a mode that failed says why."""

    stats: tuple[MemoryStats, ...]
    device: str = ""
    why: str = ""  # why the device was chosen

    def table(self) -> Table:
        """One row per mode; ratios are against the first mode that ran."""
        ran = [s for s in self.stats if not s.error]
        base = ran[0] if ran else self.stats[0]
        cuda = any(s.cuda_peak_bytes is not None for s in self.stats)
        rows = []
        for s in self.stats:
            if s.error:
                rows.append((s.mode, "failed", *["-"] * (5 + cuda), s.error))
                continue
            ratio = f"{s.saved_bytes / base.saved_bytes:.2f}x" if base.saved_bytes else "-"
            rows.append((s.mode, format_bytes(s.saved_bytes), ratio, format_bytes(s.param_bytes),
                         format_bytes(s.grad_bytes), format_bytes(s.optimizer_bytes),
                         format_bytes(s.total), *((format_bytes(s.cuda_peak_bytes),) if cuda else ()),
                         *(("",) if len(ran) < len(self.stats) else ())))
        failed = len(ran) < len(self.stats)
        on = f" on {self.device} ({self.why})" if self.device else ""
        return Table(("mode", "saved for backward", f"vs {base.mode}", "parameters", "gradients",
                      "optimizer state", "total", *(("CUDA peak",) if cuda else ()),
                      *(("failed: why",) if failed else ())), rows,
                     caption=f"memory of one training step (same model and batch){on}",
                     notes=("saved for backward: peak bytes autograd held for the backward pass "
                            "(parameters excluded; autocast's low-precision weight copies "
                            "included)",))


def memory_report(model: nn.Module, batch: Any = None, loss_fn: Callable | None = None, *,
                  optimizer: torch.optim.Optimizer | None = None,
                  modes: Iterable[Any] = DEFAULT_MODES, device: str | None = None) -> MemoryReport:
    """measure_memory under each mode on the same model and batch (32-true, bf16-mixed, bf16-true).

    A mode whose step raises gets a row saying why (the error, where, the mode's dtype); the
    others still run. Only when every mode fails is the first mode's error raised.
    """
    found = tuple(get_mode(m) for m in modes)
    if not found:
        raise ValueError("memory_report needs at least one mode, e.g. ('32-true', 'bf16-mixed')")
    step = _step_of(model, batch, loss_fn, optimizer, device)
    for m in found:
        m.check(step.where.device)
    stats, errors = [], []
    for m in found:
        try:
            stats.append(_measure(step, m))
        except Exception as e:  # noqa: BLE001 - one mode failing leaves the others' rows
            errors.append(e)
            stats.append(_failed(m, e))
    if len(errors) == len(found):
        raise errors[0]
    return MemoryReport(tuple(stats), step.where.device, step.where.why)
