"""Putting things back, in one place: every RNG, and a model's and optimizer's set-aside copy
(the global torch state is put back by `ampnb.putback_state`).

The watch, the replay, the doctor, the Workbench and `compare` take here what they are about to
change and put it back from here, so "as it was" means one thing everywhere. Only torch is
imported at import time; numpy is read when the user's code has imported it, never imported.
"""

from __future__ import annotations

import copy
import random
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampnb._interrupt import Guard

# ---------------------------------------------------------------- every RNG


def _cuda_live() -> bool:
    """CUDA is up (reading its generators before would start it)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _numpy() -> Any:
    """numpy's module when the user's code has imported it (ampnb never imports it itself)."""
    return sys.modules.get("numpy")


def _same_states(a: Any, b: Any) -> bool:
    """Two generator states alike: torch's tensor, a list of them (CUDA), numpy's tuple, None."""
    if a is None or b is None:
        return a is b
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if hasattr(a, "shape"):  # numpy's key array
        return bool((a == b).all())
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_states(x, y) for x, y in zip(a, b))
    return a == b


@dataclass(frozen=True, eq=False)
class Rng:
    """Every generator a model's forward may draw from: torch's CPU generator, every CUDA
    generator once CUDA is up, numpy's global one (once imported), Python's `random`, and the
    user's own `torch.Generator`s handed to `take` (a DataLoader's, a `randn(generator=g)`'s)."""

    cpu: torch.Tensor
    cuda: list[torch.Tensor] | None = None
    numpy: Any = None
    python: Any = None
    user: tuple[tuple[torch.Generator, torch.Tensor], ...] = ()

    @classmethod
    def take(cls, generators: Iterable[torch.Generator] = ()) -> Rng:
        """Every generator's state now (`generators`: the user's own, too)."""
        np = _numpy()
        return cls(torch.get_rng_state(), torch.cuda.get_rng_state_all() if _cuda_live() else None,
                   np.random.get_state() if np is not None else None, random.getstate(),
                   tuple((g, g.get_state()) for g in generators))

    def restore(self) -> None:
        """Every generator as taken."""
        torch.set_rng_state(self.cpu)
        if self.cuda is not None and torch.cuda.is_available():  # a GPU's file replayed on a CPU
            torch.cuda.set_rng_state_all(self.cuda)
        np = _numpy()
        if np is not None and self.numpy is not None:
            np.random.set_state(self.numpy)
        if self.python is not None:
            random.setstate(self.python)
        for g, state in self.user:
            g.set_state(state)

    def same(self, other: Rng) -> bool:
        """Whether no generator has drawn between the two records."""
        return (torch.equal(self.cpu, other.cpu) and _same_states(self.cuda, other.cuda)
                and self.python == other.python and _same_states(self.numpy, other.numpy)
                and len(self.user) == len(other.user)
                and all(g is h and torch.equal(a, b)
                        for (g, a), (h, b) in zip(self.user, other.user, strict=True)))

    def as_dict(self) -> dict[str, Any]:
        """Plain states by generator, as a saved file keeps them: data only (numpy's key array
        as a tensor), so the file loads with weights_only=True; absent generators left out; the
        user's own generators are objects of this process, not kept."""
        np_state = self.numpy
        if np_state is not None:  # ('MT19937', key array, pos, has_gauss, cached_gaussian)
            np_state = (np_state[0], torch.from_numpy(np_state[1].astype("int64")), *np_state[2:])
        found = {"torch": self.cpu, "python": self.python, "cuda": self.cuda, "numpy": np_state}
        return {k: v for k, v in found.items() if v is not None}

    @classmethod
    def from_dict(cls, states: dict[str, Any]) -> Rng:
        """The record `as_dict` wrote (numpy's state only where numpy is imported to take it)."""
        np, np_state = _numpy(), states.get("numpy")
        if np_state is not None:
            np_state = None if np is None else (
                np_state[0], np.asarray(np_state[1], dtype=np.uint32), *np_state[2:])
        return cls(states["torch"], states.get("cuda"), np_state, states.get("python"))


def user_generators(objects: Iterable[Any]) -> list[torch.Generator]:
    """The `torch.Generator`s among `objects` and those a DataLoader or sampler there draws from."""
    found: dict[int, torch.Generator] = {}
    for obj in objects:
        for g in (obj, getattr(obj, "generator", None),
                  getattr(getattr(obj, "sampler", None), "generator", None)):
            if isinstance(g, torch.Generator):
                found.setdefault(id(g), g)
    return list(found.values())


def rng_kept() -> Guard:
    """`with rng_kept():` every generator put back on the way out, whatever happened."""
    return Guard(Rng.take, Rng.restore)


def _fastpath_off() -> bool:
    was = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    return was


def fastpath_off() -> Guard:
    """`with fastpath_off():` torch's MultiheadAttention / Transformer fast path off (it turns a
    padded batch into NestedTensors that per-layer hooks and replaced layers cannot read); the
    caller's setting put back on the way out, whatever happened."""
    return Guard(_fastpath_off, torch.backends.mha.set_fastpath_enabled)


def generator(value: int, device: str | torch.device = "cpu") -> torch.Generator:
    """A generator of ampnb's own, seeded with `value`: its draws leave every other stream alone."""
    return torch.Generator(device=device).manual_seed(value)


def seed(value: int, device: str) -> None:
    """Seed every generator a run draws from, alike in each run: torch's (CUDA's when the run is
    on CUDA), numpy's global one (SpecAugment-style masks) and Python's `random`."""
    torch.default_generator.manual_seed(value)
    if torch.device(device).type == "cuda":
        torch.cuda.manual_seed_all(value)
    np = _numpy()
    if np is not None:
        np.random.seed(value % 2**32)
    random.seed(value)


# ---------------------------------------------------------------- a model's and optimizer's copy


def version(t: torch.Tensor) -> int | None:
    """The tensor's version counter (bumped by in-place writes); None for inference tensors."""
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return None


@dataclass(eq=False)
class TensorCopy:
    """One tensor's content and autograd fields as they were (not frozen: `restore` moves the
    mark that `changed` compares with)."""

    tensor: torch.Tensor
    data: torch.Tensor
    grad: torch.Tensor | None
    requires_grad: bool
    version: int | None
    ptr: int

    @classmethod
    def take(cls, t: torch.Tensor) -> TensorCopy:
        grad = t.grad.detach().clone() if t.is_leaf and t.grad is not None else None
        return cls(t, t.detach().clone(), grad, t.requires_grad, version(t), t.data_ptr())

    def restore(self) -> None:
        t = self.tensor
        if t.is_leaf and (t.grad is not None or self.grad is not None):
            t.grad = None
        same = (t.dtype, t.shape, t.device) == (self.data.dtype, self.data.shape, self.data.device)
        if not same:
            t.data = self.data.clone()
        else:  # always: some kernels (BatchNorm's running stats) write without a version bump
            with torch.no_grad():
                t.copy_(self.data)
        if t.is_leaf:
            t.requires_grad_(self.requires_grad)
            if self.grad is not None:
                t.grad = self.grad.clone()
        self.version, self.ptr = version(t), t.data_ptr()

    def changed(self) -> bool:
        """Written in place, rebound or recast since taken (or last restored)."""
        t = self.tensor
        return version(t) != self.version or t.data_ptr() != self.ptr or t.dtype != self.data.dtype


@dataclass(frozen=True, eq=False)
class ModuleFlags:
    """A module's parameter/buffer slots and train flag (the objects, not their values)."""

    module: nn.Module
    training: bool
    params: dict[str, Any]
    buffers: dict[str, Any]

    @classmethod
    def take(cls, m: nn.Module) -> ModuleFlags:
        return cls(m, m.training, dict(m._parameters), dict(m._buffers))

    def restore(self) -> None:
        m = self.module
        m.training = self.training
        if _rebound(m._parameters, self.params):  # a slot was rebound: put the original back
            m._parameters.clear()
            m._parameters.update(self.params)
        if _rebound(m._buffers, self.buffers):
            m._buffers.clear()
            m._buffers.update(self.buffers)


def _rebound(now: dict[str, Any], saved: dict[str, Any]) -> bool:
    return now.keys() != saved.keys() or any(now[k] is not v for k, v in saved.items())


def _clone(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def _groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of param_groups that keep the Parameters themselves."""
    return [{k: (list(v) if k == "params" else copy.deepcopy(v)) for k, v in g.items()}
            for g in groups]


@dataclass(frozen=True, eq=False)
class OptimizerCopy:
    """An optimizer's per-parameter state and param_groups (the Parameters kept by identity)."""

    opt: torch.optim.Optimizer
    state: dict[Any, dict[str, Any]]
    groups: list[dict[str, Any]]

    @classmethod
    def take(cls, opt: torch.optim.Optimizer) -> OptimizerCopy:
        state = {p: {k: _clone(v) for k, v in s.items()} for p, s in opt.state.items()}
        return cls(opt, state, _groups(opt.param_groups))

    def restore(self) -> None:
        self.opt.state.clear()
        self.opt.state.update({p: {k: _clone(v) for k, v in s.items()}
                               for p, s in self.state.items()})
        self.opt.param_groups[:] = _groups(self.groups)


@dataclass(frozen=True, eq=False)
class ObjectCopy:
    """A GradScaler's or LR scheduler's attributes; the objects in `shared` kept by identity."""

    obj: Any
    shared: dict[int, Any]
    saved: dict[str, Any]

    @classmethod
    def take(cls, obj: Any, shared: dict[int, Any]) -> ObjectCopy:
        return cls(obj, shared, copy.deepcopy(dict(vars(obj)), dict(shared)))

    def restore(self) -> None:
        attrs = vars(self.obj)
        attrs.clear()
        attrs.update(copy.deepcopy(self.saved, dict(self.shared)))


@dataclass(frozen=True, eq=False)
class Grads:
    """A model's gradients set aside (held, or in the file `path`) and cleared; `restore` puts
    each parameter's back (None where it had none)."""

    model: nn.Module
    held: dict[str, torch.Tensor]  # by parameter name; {} when they wait in the file
    path: str | None = None

    @classmethod
    def take(cls, model: nn.Module, path: str | None = None) -> Grads:
        held = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        if path is not None:  # on disk: the process holds one model's gradients, not two
            torch.save(held, path)
            held = {}
        for p in model.parameters():
            p.grad = None  # what runs meanwhile must not add into them
        return cls(model, held, path)

    def restore(self) -> None:
        held = self.held if self.path is None else torch.load(self.path, weights_only=True)
        for n, p in self.model.named_parameters():
            p.grad = held.get(n)


@dataclass(frozen=True, eq=False)
class _Probe:
    """What a forward and backward without an update change: buffers, grads and the RNG."""

    buffers: tuple[TensorCopy, ...]
    grads: Grads
    rng: Rng

    @classmethod
    def take(cls, model: nn.Module) -> _Probe:
        buffers = tuple(TensorCopy.take(b) for b in model.buffers())
        return cls(buffers, Grads.take(model), Rng.take())

    def restore(self) -> None:
        for b in self.buffers:
            b.restore()
        self.grads.restore()
        self.rng.restore()


def untouched(model: nn.Module) -> Guard:
    """`with untouched(model):` a probe without a trace: every RNG, the buffers (BatchNorm
    stats) and the grads are put back, also when it raises or is interrupted."""
    return Guard(lambda: _Probe.take(model), _Probe.restore)
