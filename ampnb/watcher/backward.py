"""The watch's side of a backward: a micro-batch is a backward that reached the watched model's
outputs and ended; its losses are the roots of the backward call that did (`ampnb.backwards`)."""

from __future__ import annotations

import math
import time
import warnings
from typing import Any

import torch

from ampnb import backwards
from ampnb._interrupt import critical
from ampnb.watcher import summary
from ampnb.watcher.hooks import Hook


class Backwards:
    """What a `Watch` does when a backward reaches its model (a mixin: the watch's state)."""

    _state: Any
    _done: int
    _grad_call: bool
    _stepping: str | None
    _rooted_in_step: bool
    _warned: bool

    def _reached(self, grad: torch.Tensor) -> None:
        """A backward reached the model's outputs (any thread): a micro-batch once it ends
        (a backward that fails is none), unless an autograd.grad (no step's gradients)."""
        if not self._grad_call:
            torch.autograd.Variable._execution_engine.queue_callback(Hook(self._backward_done))

    def _backward_done(self) -> None:
        s = self._current()
        s.micro_batches += 1
        self._done += 1
        if math.isnan(s.t0):
            s.t0 = time.perf_counter()
        self._token = self._grads()
        if s.stats and s.first is None and s.grads_first is None:
            s.grads_first = summary.grads_module(self._modules, self._stats)
        if s.stats and self._scaler is not None:  # still scaled (unscaled here); a
            # skipped step's are gone by the time its end is seen (zero_grad)
            s.read_grads(self._modules, self._stats, s.scale or 1.0)

    def _on_backward(self, call: Any, roots: list[torch.Tensor]) -> _After:
        """A backward call starts from `roots` in the loop's thread: its losses, if it turns
        out to have reached this model's outputs."""
        return _After(self, call is backwards.GRAD, roots)

    def _rooted(self, roots: list[torch.Tensor]) -> None:
        """The losses of a backward that fed this step (a closure step keeps its first: the
        loss `step()` returns)."""
        s = self._state
        if s is None:
            return
        if self._stepping == "closure":
            roots = [] if self._rooted_in_step else roots
            self._rooted_in_step = True
        s.after_backward(roots)

    def failed(self, e: Exception) -> None:
        """A hook of the watch failed: one warning per watch, the step's record incomplete."""
        if self._state is not None:
            self._state.incomplete = True
        if not self._warned:
            self._warned = True
            warnings.warn(f"ampnb.watch: one of its hooks failed ({type(e).__name__}: {e}); "
                          "the step's record is marked incomplete, and training goes on",
                          RuntimeWarning, stacklevel=3)


def in_backward() -> bool:
    """A backward runs in this thread now: a forward here is a reentrant checkpoint's
    recomputation, not a micro-batch's (the graph task id register_multi_grad_hook keys on)."""
    return torch._C._current_graph_task_id() != -1


class _After:
    """The context a backward call runs in for a watch: its roots go to the watch if the
    backward reached the watch's model and ended without an error."""

    def __init__(self, watch: Backwards, grad: bool, roots: list[torch.Tensor]) -> None:
        self.watch, self.grad, self.roots, self.before = watch, grad, roots, 0

    def __enter__(self) -> None:
        self.before, self.watch._grad_call = self.watch._done, self.grad

    @critical
    def __exit__(self, kind: Any, *_: Any) -> None:
        w = self.watch
        w._grad_call = False
        if kind is None and w._done != self.before:
            try:
                w._rooted(self.roots)
            except Exception as e:  # never an error in the user's backward
                w.failed(e)
