"""`ampnb.watch(model, optimizer, scaler)`: one StepRecord per optimizer step of the user's loop.

Hooks only, the loop unchanged and nothing of it run twice: a forward pre-hook on the model (and
its children), forward hooks on every module on statistics steps (tensor hooks on their
outputs), the optimizer's step pre/post hooks, the scaler read through `get_scale()` only. A
micro-batch is a backward that reached the model's own outputs and ended (a multi-grad hook on
them, in whatever thread runs it); its losses are the roots of the backward call that did, seen
through `ampnb.backwards`' TorchFunctionMode, armed in the loop's thread from the model's
forward's end to the next forward or step. A failure in any of these hooks is one warning and a
record marked incomplete, never an error in the user's step. A step ends at the optimizer's step
post hook (a step given a closure, LBFGS's, is one step however often it calls it); a
step the GradScaler skipped (it never calls optimizer.step, unless fused: then its found_inf says
so) is seen to have ended at the next forward (its gradients reset, or the scale backed off), or
at `close()`/`records`. Without a GradScaler nothing is read back from the device between
statistics steps (with one, its scale is: `scaler.step` itself reads found_inf every step): those
steps' records are made at the next statistics step, `close()` or `records`, and callbacks get
them then.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ampnb import _interrupt, backwards
from ampnb._interrupt import Guard, critical
from ampnb._tree import map_tensors
from ampnb.putback import Rng
from ampnb.start import param_dtype
from ampnb.step import _AUTOCAST_DEVICES
from ampnb.watcher import inputs, owner, stepping
from ampnb.watcher.backward import Backwards, in_backward
from ampnb.watcher.ending import Ending
from ampnb.watcher.hooks import Hook, StepState, fast_probe, float_outputs, module_names
from ampnb.watchlog.records import StepRecord, log_path

_NARROW = (torch.float16, torch.bfloat16)


def _rank() -> int | None:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


def _tensorboard(log_dir: Any, rank: int | None) -> Any:
    """ampnb's TensorBoard writer where the tensorboard package imports, else None."""
    try:
        from ampnb.watcher.tensorboard import TensorBoardWriter

        return TensorBoardWriter(log_dir, rank)
    except ImportError:  # an optional extra: absent, the JSON lines alone
        return None


class Watch(Backwards, Ending):
    """Records the user's own training loop per optimizer step (see `ampnb.watch`)."""

    def __init__(self, model: nn.Module, optimizer: Any, scaler: Any = None, *, every: int = 1,
                 log_dir: Any = None, keep_overflow: Any = None) -> None:
        model = inputs.unwrap_model(model)
        self._optimizer = inputs.unwrap_optimizer(model, optimizer)
        self._scaler = inputs.check_scaler(scaler)
        self.every = inputs.check_every(every)
        self.rank = _rank()
        self.log_dir = inputs.check_log_dir(log_dir, self.rank)
        self.keep_overflow = inputs.check_keep_overflow(keep_overflow)
        self._model = model
        self._modules, self.names, self._stats = module_names(model)
        self._stat_set = frozenset(self._stats)
        self._true_mode = param_dtype(model, mostly=True) in _NARROW
        self._records: list[StepRecord] = []
        self._ended: list[StepState] = []  # ended steps whose record is not made yet
        self._callbacks: list[Callable[[StepRecord], Any]] = []
        self._state: StepState | None = None
        self._token: tuple | None = None  # the gradients as the last backward left them
        self._done = 0  # micro-batches whose backward ended, all steps
        self._grad_call = False  # an autograd.grad runs now: it feeds no step
        self._stepping: str | None = None  # inside its optimizer's step: 'plain' or 'closure'
        self._rooted_in_step = False  # a closure step's first loss was taken (step() returns it)
        self._warned = False
        self._armed: list[Any] = []  # the modules' forward hooks, there on statistics steps
        self._entered: nn.Module | None = None  # the entry module whose forward runs now
        self._keeping = self.keep_overflow is not None  # until kept (or a save failed)
        # where a step's forward may enter: the model, or one of its children called directly
        # (a LightningModule's training_step calling self.model(x))
        self._entries = {id(m): name for name, m in
                         [("", model), *model.named_children()]}
        self.overflow_file: Any = None  # the file keep_overflow wrote, once it has
        self._log = log_path(self.log_dir, self.rank) if self.log_dir is not None else None
        self._shown = repr(os.fspath(log_dir)) if log_dir is not None else ""  # the user's spelling
        self._tb: Any = None
        self._guard = Guard(self._attach, self._detach)
        # entered, not applied: ampnb's SIGINT handler stays until close(), so an interrupt
        # landing in the watch's own code (its hooks, close) is held until it is consistent
        self._guard.__enter__()

    # ----- public ----------------------------------------------------------------------------

    @property
    def records(self) -> tuple[StepRecord, ...]:
        """One record per optimizer step seen so far (reading them reads the device)."""
        if self._model is not None:
            self._settle()
            self._make_records()
        return tuple(self._records)

    def on_record(self, callback: Callable[[StepRecord], Any]) -> None:
        """Call callback(record) for every record from now on, as it is made: at a statistics
        step's end (with those of the steps before it), at close(), or when records is read."""
        self._callbacks.append(callback)

    def log_loss(self, loss: float | torch.Tensor) -> None:
        """Report a micro-batch's loss, undivided and unscaled (the step's loss is their mean);
        given, these replace the backward roots the watch saw. Not read until recorded."""
        value = loss.detach() if isinstance(loss, torch.Tensor) else float(loss)
        self._current().explicit.append(value)

    def table(self) -> Any:
        """The records as a table."""
        from ampnb.watchlog.table import records_table

        return records_table(self.records)

    def plot(self, ax: Any = None) -> Any:
        """Scale, skipped steps and headroom per layer over steps."""
        from ampnb.display import view

        return view("watch.plot")(self.records, ax=ax)

    def panel(self) -> Any:
        """A live ipywidgets view of the records."""
        from ampnb.display import view

        return view("watch.panel")(self)

    @critical
    def close(self) -> None:
        """Record what is pending, remove every hook; the model is no longer referenced."""
        if self._model is not None:
            self._settle()
            self._make_records()
        self._guard.__exit__(None, None, None)

    @critical
    def __enter__(self) -> Watch:
        if _interrupt._pending:  # interrupted on the way in: close, then raise it
            self.close()
        return self

    @critical
    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        skipped = sum(r.skipped for r in self._records)
        return (f"<ampnb.watch: {len(self._records)} steps, {skipped} skipped, "
                f"every={self.every}{'' if self._model is not None else ', closed'}>")

    # ----- attach / detach -------------------------------------------------------------------

    def _attach(self) -> list[Callable[[], None]]:
        undo: list[Callable[[], None]] = []
        try:
            if self._log is not None:  # one watch per log_dir: another is refused until close()
                undo.append(owner.claim(self._log, self._shown))
            undo.append(lambda: self._arm(False))
            undo.append(lambda: backwards.disarm(self))  # this thread's (a loop's own
            # thread disarms at its next step)
            undo.append(backwards.release)  # a forward an interrupt cut: its mode back
            for m in [self._model, *self._model.children()]:
                undo.append(m.register_forward_pre_hook(
                    Hook(self._on_forward_start), with_kwargs=True).remove)
                undo.append(m.register_forward_hook(Hook(self._on_forward_end),
                                                    always_call=True).remove)
            opt = self._optimizer
            undo.append(lambda: stepping.forget(opt))
            undo.append(opt.register_step_pre_hook(Hook(self._pre_step)).remove)
            undo.append(opt.register_step_post_hook(Hook(self._post_step)).remove)
            if self.log_dir is not None:
                self._tb = _tensorboard(self.log_dir, self.rank)
        except BaseException:
            self._detach(undo)
            raise
        return undo

    def _detach(self, undo: list[Callable[[], None]]) -> None:
        while undo:
            undo.pop()()
        if self._tb is not None:
            self._tb.close()
        # no reference to the user's objects outlives close()
        self._model = self._optimizer = self._scaler = self._state = self._tb = None
        self._modules, self._ended = [], []

    @critical
    def _arm(self, on: bool) -> None:
        """Hook every module's forward (statistics steps), or remove those hooks."""
        if on and not self._armed:
            for i, m in enumerate(self._modules):
                self._armed.append(m.register_forward_hook(Hook(self._on_output, i)))
        while not on and self._armed:
            self._armed.pop().remove()

    # ----- what the hooks see ---------------------------------------------------------------

    def _current(self) -> StepState:
        if self._state is None:
            # the scale is read once a step, at its start (a GradScaler's own step() reads
            # found_inf back from the device on every step anyway)
            scale = float(self._scaler.get_scale()) if self._scaler is not None else None
            self._state = StepState(self._next_is_stats(), scale)
            self._state.report = self.failed
            if self._keeping and self._scaler is not None:  # as it was before the step
                self._state.scaler_state = self._scaler.state_dict()
            self._arm(self._state.stats)
        return self._state

    def _next_is_stats(self) -> bool:
        return (len(self._records) + len(self._ended)) % self.every == 0

    def _grads(self) -> tuple:
        """Which gradients the optimizer holds, as a token: any in-place change (zero_grad,
        unscale_, clip) or reset (set_to_none) between a backward and the next makes it differ."""
        for g in self._optimizer.param_groups:
            for p in g["params"]:
                if p.grad is not None:  # a Tensor's version counts its in-place writes
                    return id(p), id(p.grad), p.grad._version
        return ()

    def _settle(self) -> None:
        """A step with no optimizer.step since its last backward has ended when its GradScaler's
        update changed the scale, or its gradients were reset since (zero_grad; Lightning zeroes
        them only after the next forward): skipped by the scaler. Without a scaler, gradients
        reset without a step were thrown away by the loop: no step, no record."""
        s = self._state
        if s is None or not s.micro_batches:
            return
        reset = self._token is not None and self._grads() != self._token
        if self._scaler is not None and (reset or float(self._scaler.get_scale()) != s.scale):
            self._finish(skipped=True)
        elif reset:
            self._state, self._token = None, None
            self._arm(self._next_is_stats())

    def _on_forward_start(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        backwards.suspend(module)  # off the stack through the forward: no backward starts there
        # inside another entry's forward (the model's, calling its children); validation,
        # inference. The same entry again is a new call: its end hook, which torch runs on
        # exceptions but not on a KeyboardInterrupt, may not have run
        if (self._entered is not None and self._entered is not module
                or not torch.is_grad_enabled() or in_backward()):
            return
        backwards.disarm(self)  # the losses from here on are this forward's
        if self._stepping == "plain":  # a forward after a step whose post hooks never ran:
            self._stepping = None      # that step raised, and was no step
        if self._stepping is None:  # a closure's forwards are inside one step
            self._settle()
        self._entered = module
        s = self._current()
        if math.isnan(s.t0):
            s.t0 = time.perf_counter()
            s.autocast = [(d, torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES
                          if torch.is_autocast_enabled(d)]
        if self._keeping:
            if s.rng is None:
                s.rng = Rng.take()
            s.inputs.append(map_tensors(lambda t: t.detach(), (args, dict(kwargs))))
            s.entries.append(self._entries[id(module)])

    def _on_forward_end(self, module: nn.Module, args: Any, out: Any) -> None:
        backwards.resume(module)
        if self._entered is not module:
            return
        self._entered = None
        outs = [t for t in float_outputs(out) if t.requires_grad]
        if outs:  # a backward that reaches them is this model's micro-batch; its losses
            # come through the mode, in this thread until the next forward or step
            torch.autograd.graph.register_multi_grad_hook(outs, Hook(self._reached), mode="any")
            backwards.arm(self, self._on_backward)
        s = self._state
        if self._keeping and s is not None and len(s.out_grads) < len(s.inputs):
            # the gradient the user's loss sent into each output: replay's backward is theirs
            grads: list[torch.Tensor | None] = []
            for k, t in enumerate(float_outputs(out)):
                grads.append(None)
                if t.requires_grad:
                    t.register_hook(Hook(_keep_grad, grads, k))
            s.out_grads.append(grads)

    def _on_output(self, i: int, module: nn.Module, args: Any, out: Any) -> None:
        # no grad: inference, unless inside a training forward (a reentrant checkpoint's region)
        if not torch.is_grad_enabled() and self._entered is None:
            return
        s = self._state or self._current()
        s.on_output(i, s.stats and i in self._stat_set, args, out)

    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        stepping.started(optimizer)
        closure = backwards.runs_inside(args, kwargs)
        self._stepping, self._rooted_in_step = ("closure" if closure else "plain"), False
        if not closure:  # off the stack through the update
            backwards.suspend(optimizer)
            backwards.disarm(self)
        s = self._current()
        # A GradScaler hands an optimizer that unscales inside its own (fused) step the scale
        # and its found_inf as these two attributes, and calls its step even to skip it
        found = getattr(optimizer, "found_inf", None)
        if self._scaler is not None and isinstance(found, torch.Tensor):
            s.found_inf = found  # read when the record is made
        if s.stats and not s.grads_read:  # with a GradScaler: read as backward left them
            scaled = isinstance(getattr(optimizer, "grad_scale", None), torch.Tensor)
            s.read_grads(self._modules, self._stats, s.scale if scaled and s.scale else 1.0)
        if self._scaler is None and (s.stats or self._keeping):
            # a pass over every gradient: on statistics steps (and to keep an overflow) only;
            # between them a step is non-finite by its loss (a non-finite update makes the
            # next step's loss so: seen one step late at worst)
            gs = [p.grad for g in optimizer.param_groups for p in g["params"]
                  if p.grad is not None]
            s.grads_probe = torch.stack([fast_probe(g) for g in gs]).sum() if gs else None
            if self._keeping and not math.isfinite(self._probe(s)):
                self._keep(s)  # before the update changes the weights (a read: keep_overflow)
        if self._true_mode and s.stats:
            s.before = [(p, p.detach().clone(), (p.grad != 0) & torch.isfinite(p.grad))
                        for g in optimizer.param_groups for p in g["params"]
                        if p.grad is not None and p.dtype in _NARROW]

    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        try:
            backwards.resume(optimizer)
            self._stepping = None
            self._finish(skipped=False)
        finally:
            stepping.ended(optimizer)

def _keep_grad(grads: list, k: int, g: torch.Tensor) -> None:
    grads[k] = g.detach()


@critical
def watch(model: nn.Module, optimizer: Any, scaler: Any = None, *, every: int = 1,
          log_dir: Any = None, keep_overflow: Any = None) -> Watch:
    """Record the user's own training loop per optimizer step, through hooks only.

    As a context manager, or until `close()`. See docs/watch.md.
    """
    w = Watch(model, optimizer, scaler, every=every, log_dir=log_dir,
              keep_overflow=keep_overflow)
    if _interrupt._pending:  # held while it returned: close, then raise it
        w.close()
    return w


__all__ = ["Watch", "watch"]
