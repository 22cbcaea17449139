"""Capture weights, activations and gradients of any nn.Module as small on-device summaries."""

from __future__ import annotations

import fnmatch
import weakref
from collections.abc import Iterable

import torch
from torch import nn

from ampnb._interrupt import Guard
from ampnb._tree import named_tensors
from ampnb.display import Table, TableView, format_percent
from ampnb.formats import get_format
from ampnb.instruments.summaries import (
    DEFAULT_FORMATS,
    KINDS,
    Staged,
    TensorStats,
    exact_copy,
    stage,
    stage_many,
    summarize_many,
)

_ENGINE = torch.autograd.Variable._execution_engine


def _float_tensors(out: object) -> list[tuple[str, torch.Tensor]]:
    """(path suffix, tensor) of the floating-point tensors inside a module output."""
    if isinstance(out, torch.Tensor):  # most modules: no container to walk
        return [("", out)] if out.is_floating_point() else []
    return [(path, t) for path, t in named_tensors(out) if t.is_floating_point()]


class Capture(TableView, Guard):
    """Context manager: attach hooks on enter, remove every one of them on exit (a Guard: an
    interrupt at any line leaves the model with no hook of ours).

    Forward calls of the model are counted; one in `every` is captured (the first one, then
    every `every`-th), with the backward that follows it. Between captured calls only one
    hook stays on the model, so capture can stay attached while a model trains.
    """

    def __init__(self, model: nn.Module, kinds: Iterable[str] = ("weight", "activation",
                 "gradient"), modules: str | Iterable[str] = "*",
                 formats: Iterable[str] = DEFAULT_FORMATS, keep: bool = False,
                 every: int = 1) -> None:
        Guard.__init__(self, self._attach, self._detach)
        if not isinstance(model, nn.Module):
            raise ValueError(f"capture needs an nn.Module, got {type(model).__name__}")
        self.kinds = tuple(kinds)
        bad = [k for k in self.kinds if k not in KINDS]
        if bad:
            raise ValueError(f"unknown tensor kind {bad[0]!r}; allowed: {', '.join(KINDS)}")
        self.formats = tuple(get_format(f).name for f in formats)
        if not self.formats:
            raise ValueError("capture needs at least one format, e.g. formats=('fp16', 'bf16')")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int (capture one forward call in "
                             f"every), got {every!r}")
        self.patterns = (modules,) if isinstance(modules, str) else tuple(modules)
        self.model, self.keep, self.every = model, keep, every
        self.forwards = 0  # forward calls of the model seen inside the block
        self._stats: dict[tuple[str, str], TensorStats | None] = {}  # None: not summarized yet
        self._pending: dict[tuple[str, str], Staged] = {}  # staged, not summarized yet
        self._handles: list[torch.utils.hooks.RemovableHandle] = []  # live until exit
        self._armed: list[torch.utils.hooks.RemovableHandle] = []  # only while capturing
        # per id of a tensor seen in this forward call: (the tensor, its version, its Staged)
        self._copies: dict[int, tuple[weakref.ref, int, Staged]] = {}
        self._targets: list[tuple[str, nn.Module, list[tuple[str, torch.Tensor]]]] = []
        self._grads: list[tuple[torch.Tensor, str, str]] = []  # accumulated, not staged yet
        self._grads_task = -1  # the backward whose end stages them

    def _wanted(self, path: str) -> bool:
        """Whether a module path matches one of the module patterns."""
        return any(fnmatch.fnmatchcase(path, p) for p in self.patterns)

    def _record(self, x: torch.Tensor, name: str, kind: str, module: str,
                flat_abs: torch.Tensor | None = None) -> None:
        """Stage one tensor a hook sees (flat_abs: |x| staged already)."""
        # Only |x| is staged here (weights too: an optimizer step may change them in place);
        # summaries wait for the first look and are then computed for all tensors together,
        # which costs far less than one call per tensor. This runs for every tensor every
        # hook sees: it is kept to a few calls.
        key = (name, kind)
        old = self._pending.get(key) or self._stats.get(key)
        if old is None:
            calls = 1
            self._stats[key] = None  # (the order records first appear in)
        else:
            calls = old.calls + 1
        if flat_abs is not None:
            self._pending[key] = Staged(flat_abs, tuple(x.shape), x.dtype, name, kind, module,
                                        calls, exact_copy(x) if self.keep else None)
            return
        # One private copy per tensor object and version: a container's output is usually
        # its last child's output, and is then staged (and later summarized) once.
        seen = self._copies.get(id(x))
        if seen is not None and seen[0]() is x and seen[1] == x._version:
            earlier = seen[2]
            self._pending[key] = Staged(earlier.flat_abs, earlier.shape, earlier.dtype, name,
                                        kind, module, calls, earlier.tensor)
        else:
            staged = self._pending[key] = Staged(
                stage(x), tuple(x.shape), x.dtype, name, kind, module, calls,
                exact_copy(x) if self.keep else None)
            self._copies[id(x)] = (weakref.ref(x), x._version, staged)

    def _record_many(self, found: list[tuple[torch.Tensor, str, str]], kind: str) -> None:
        """_record of many (tensor, name, module) at once, staged together."""
        for (x, name, module), flat_abs in zip(found, stage_many([x for x, _, _ in found])):
            self._record(x, name, kind, module, flat_abs)

    def _flush(self) -> None:
        """Summarize every staged tensor (at the first look after new ones)."""
        self._copies.clear()
        self._stage_grads()  # a backward that raised never reached its end
        if self._pending:
            pending, self._pending = self._pending, {}
            for key, stats in zip(pending, summarize_many(pending.values(), self.formats)):
                self._stats[key] = stats

    def _forward_hook(self, path: str):
        """The forward hook of the module at path: stages its floating-point outputs."""
        # Decided once per module, not per call: this runs for every module of every step.
        base, record = path or "(output)", self._record
        acts, grads = "activation" in self.kinds, "activation_gradient" in self.kinds

        def hook(module: nn.Module, args: object, out: object) -> None:
            for suffix, tensor in _float_tensors(out):
                name = base + suffix if suffix else base
                if acts:
                    record(tensor, name, "activation", path)
                if grads and tensor.requires_grad:
                    self._handles.append(tensor.register_hook(
                        lambda g, name=name: record(g, name, "activation_gradient", path)))
        return hook

    def _grad_hook(self, name: str, path: str):
        """The post-accumulate-grad hook of one parameter: queues its gradient for staging."""
        def hook(param: torch.Tensor) -> None:
            grad = param.grad
            if grad is not None:
                self._grads.append((grad, name, path))
                task = torch._C._current_graph_task_id()
                if task == -1:  # called outside a backward: nothing to wait for
                    self._stage_grads()
                elif task != self._grads_task:  # the first gradient of this backward
                    self._grads_task = task
                    _ENGINE.queue_callback(self._stage_grads)
        return hook

    def _stage_grads(self) -> None:
        """Stage the gradients accumulated in a backward, all together, when it ends: after
        the other hooks of that backward, before any code after backward() can change them
        (clipping, zero_grad, an optimizer step)."""
        found, self._grads = self._grads, []
        if found:
            self._record_many(found, "gradient")

    def _on_forward(self, module: nn.Module, args: object) -> None:
        """Root pre-hook: decide whether this forward call is captured, (dis)arm the rest."""
        n, self.forwards = self.forwards, self.forwards + 1
        self._copies.clear()
        if n % self.every:
            self._disarm()
            return
        if n and "weight" in self.kinds:  # call 0 uses the weights copied on entry
            self._record_weights()
        self._arm()

    def _record_weights(self) -> None:
        """Stage every floating-point parameter of the hooked modules, all together."""
        self._record_many([(p, full, path) for path, _, params in self._targets
                           for full, p in params if p.is_floating_point() and p.numel()],
                          "weight")

    def _arm(self) -> None:
        """Hook the modules and parameters for one captured forward call and its backward."""
        if self._armed:
            return
        acts = "activation" in self.kinds or "activation_gradient" in self.kinds
        for path, m, params in self._targets:
            if acts:
                self._armed.append(m.register_forward_hook(self._forward_hook(path)))
            if "gradient" in self.kinds:
                self._armed.extend(p.register_post_accumulate_grad_hook(self._grad_hook(full, path))
                                   for full, p in params if p.requires_grad)

    def _disarm(self) -> None:
        """Remove the per-call hooks (the root pre-hook stays)."""
        for h in self._armed:
            h.remove()
        self._armed.clear()

    def _attach(self) -> Capture:
        """Hook the model (Guard's enter: all hooks or none, interrupts held back)."""
        try:
            every = self.patterns == ("*",)
            # A module's own parameters straight from _parameters: named_parameters() walks
            # them through generators, which costs more than hooking the module.
            self._targets = [(path, m, [(f"{path}.{n}" if path else n, p)
                                        for n, p in m._parameters.items() if p is not None])
                             for path, m in self.model.named_modules()
                             if every or self._wanted(path)]
            if "weight" in self.kinds:
                self._record_weights()
            self._handles.append(self.model.register_forward_pre_hook(self._on_forward))
            self._arm()  # the first forward call (and a backward before any) is captured
        except BaseException:
            self._detach()
            raise
        return self

    def _detach(self, _: object = None) -> None:
        """Remove every hook (Guard's exit). Summaries are computed at the first look."""
        self._disarm()
        while self._handles:
            self._handles.pop().remove()
        self._copies.clear()

    @property
    def records(self) -> list[TensorStats]:
        """Every captured tensor, in the order first seen."""
        self._flush()
        return [s for s in self._stats.values() if s is not None]

    def select(self, kind: str | None = None, name: str = "*") -> list[TensorStats]:
        """Records of one kind whose name matches a glob pattern."""
        return [s for s in self.records
                if (kind is None or s.kind == kind) and fnmatch.fnmatchcase(s.name, name)]

    def get(self, name: str, kind: str) -> TensorStats:
        """One record by exact name and kind."""
        self._flush()
        try:
            return self._stats[(name, kind)]  # type: ignore[return-value]
        except KeyError:
            names = sorted({n for n, k in self._stats if k == kind})
            raise ValueError(f"no {kind} named {name!r} was captured; captured: "
                             f"{', '.join(names) or 'none'}") from None

    def table(self, fmt: str | None = None) -> Table:
        """One row per captured tensor: shape, range, and coverage in one format (default: first)."""
        f = get_format(fmt).name if fmt is not None else self.formats[0]
        rows = []
        for s in self.records:
            c = s.coverage(f) if s.coverages else None
            pct = format_percent if c else (lambda v: "-")
            rows.append((s.name, s.kind, "x".join(map(str, s.shape)) or "scalar", s.dtype,
                         f"{s.amax:.3g}", f"{s.min_nonzero:.3g}",
                         pct(c.overflow if c else 0), pct(c.underflow if c else 0),
                         pct(c.subnormal if c else 0)))
        return Table(("tensor", "kind", "shape", "dtype", "amax", "min |x|>0",
                      f"{f} overflow", f"{f} underflow", f"{f} subnormal"), rows,
                     caption=f"captured tensors against {f}")


def capture(model: nn.Module, kinds: Iterable[str] = ("weight", "activation", "gradient"),
            modules: str | Iterable[str] = "*", formats: Iterable[str] = DEFAULT_FORMATS,
            keep: bool = False, every: int = 1) -> Capture:
    """`with capture(model) as cap:` records summaries of the selected tensors."""
    return Capture(model, kinds, modules, formats, keep, every)
