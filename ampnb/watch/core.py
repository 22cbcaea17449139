"""`ampnb.watch(model, optimizer, scaler)`: one StepRecord per optimizer step of the user's loop.

Hooks only, the loop unchanged: a forward pre-hook on the model, forward hooks on every module
on statistics steps (tensor hooks on their outputs; between them a non-finite forward is run
again to name the module, see rerun.py), the optimizer's step pre/post hooks, `scale`/`update` wrapped on the scaler instance, and
autograd's engine call (ampnb.step's) to see each backward's root, the loss. A step ends at
`scaler.update()` when there is a scaler (a skipped step never calls optimizer.step), else at
the optimizer's step post hook; every backward before it is one of its micro-batches.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ampnb import _interrupt
from ampnb._interrupt import Guard, critical
from ampnb._tree import map_tensors
from ampnb.start import param_dtype
from ampnb.step import _AUTOCAST_DEVICES, _engine_in, _engine_out
from ampnb.watch import inputs, overflow, rerun, summary
from ampnb.watch.hooks import Hook, StepState, module_names
from ampnb.watch.records import StepRecord, log_path, write

_NARROW = (torch.float16, torch.bfloat16)


def _rank() -> int | None:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


def _tensorboard(log_dir: Any, rank: int | None) -> Any:
    """ampnb's TensorBoard writer where the tensorboard package imports, else None."""
    try:
        from ampnb.watch.tensorboard import TensorBoardWriter

        return TensorBoardWriter(log_dir, rank)
    except ImportError:  # an optional extra: absent, the JSON lines alone
        return None


class Watch:
    """Records the user's own training loop per optimizer step (see `ampnb.watch`)."""

    def __init__(self, model: nn.Module, optimizer: Any, scaler: Any = None, *, every: int = 1,
                 log_dir: Any = None, keep_overflow: Any = None) -> None:
        model = inputs.unwrap_model(model)
        self._optimizer = inputs.unwrap_optimizer(model, optimizer)
        self._scaler = inputs.check_scaler(scaler)
        self.every = inputs.check_every(every)
        self.log_dir = inputs.check_path("log_dir", log_dir)
        self.keep_overflow = inputs.check_path("keep_overflow", keep_overflow)
        self._model = model
        self._modules, self.names, self._stats = module_names(model)
        self._stat_set = frozenset(self._stats)
        self._true_mode = param_dtype(model, mostly=True) in _NARROW
        self._records: list[StepRecord] = []
        self._callbacks: list[Callable[[StepRecord], Any]] = []
        self._state: StepState | None = None
        self._scaled: set[int] = set()  # ids of what scaler.scale returned this step
        self._fresh = False  # the model ran a forward since the last backward counted
        self._armed: list[Any] = []  # the modules' forward hooks, there on statistics steps
        self._rerunning = False  # a non-finite forward runs again: not a step's forward
        self._entered: nn.Module | None = None  # the entry module whose forward runs now
        # where a step's forward may enter: the model, or one of its children called directly
        # (a LightningModule's training_step calling self.model(x))
        self._entries = {id(m): name for name, m in
                         [("", model), *model.named_children()]}
        self.rank = _rank()
        self.overflow_file: Any = None  # the file keep_overflow wrote, once it has
        self._log = log_path(log_dir, self.rank) if log_dir is not None else None
        self._tb: Any = None
        self._guard = Guard(self._attach, self._detach)
        # entered, not applied: ampnb's SIGINT handler stays until close(), so an interrupt
        # landing in the watch's own code (its hooks, close) is held until it is consistent
        self._guard.__enter__()

    # ----- public ----------------------------------------------------------------------------

    @property
    def records(self) -> tuple[StepRecord, ...]:
        """One record per optimizer step seen so far."""
        return tuple(self._records)

    def on_record(self, callback: Callable[[StepRecord], Any]) -> None:
        """Call callback(record) at the end of every step from now on."""
        self._callbacks.append(callback)

    def log_loss(self, loss: float | torch.Tensor) -> None:
        """Report the step's (unscaled) loss; it replaces the backward roots the watch saw."""
        value = loss.detach() if isinstance(loss, torch.Tensor) else loss
        self._current().explicit.append(float(value))

    def table(self) -> Any:
        """The records as a table."""
        from ampnb.watch.table import records_table

        return records_table(self.records)

    def plot(self, ax: Any = None) -> Any:
        """Scale, skipped steps and headroom per layer over steps."""
        from ampnb.plots.watch import plot_records

        return plot_records(self.records, ax=ax)

    def panel(self) -> Any:
        """A live ipywidgets view of the records."""
        from ampnb.panels.watch_panel import WatchPanel

        return WatchPanel(self)

    @critical
    def close(self) -> None:
        """Remove every hook, put back what was wrapped; the model is no longer referenced."""
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
            undo.append(lambda: self._arm(False))
            for m in [self._model, *self._model.children()]:
                undo.append(m.register_forward_pre_hook(
                    Hook(self._on_forward_start), with_kwargs=True).remove)
                undo.append(m.register_forward_hook(Hook(self._on_forward_end),
                                                    always_call=True).remove)
            opt = self._optimizer
            undo.append(opt.register_step_pre_hook(Hook(self._pre_step)).remove)
            undo.append(opt.register_step_post_hook(Hook(self._post_step)).remove)
            if self._scaler is not None:
                undo.append(self._wrap(self._scaler, "scale", self._scale))
                undo.append(self._wrap(self._scaler, "update", self._update))
            previous = _engine_in(self._engine)
            undo.append(lambda: _engine_out(previous))
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
        self._modules = []

    @staticmethod
    def _wrap(obj: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]
              ) -> Callable[[], None]:
        own = obj.__dict__.get(name, None)
        setattr(obj, name, make(getattr(obj, name)))

        def undo() -> None:
            if own is None:
                obj.__dict__.pop(name, None)
            else:
                setattr(obj, name, own)
        return undo

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
            self._state = StepState(len(self._records) % self.every == 0)
            self._arm(self._state.stats)
        return self._state

    def _on_forward_start(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        # inside another entry's forward (the model's, calling its children); validation,
        # inference; a rerun. The same entry again is a new call: its end hook, which torch runs
        # on exceptions but not on a KeyboardInterrupt, may not have run
        if (self._entered is not None and self._entered is not module
                or not torch.is_grad_enabled() or self._rerunning):
            return
        self._entered = module
        s = self._current()
        self._fresh = True
        autocast = [(d, torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES
                    if torch.is_autocast_enabled(d)]
        if math.isnan(s.t0):
            s.t0 = time.perf_counter()
            s.autocast = autocast
        if not s.stats:  # no module hooked: what a rerun of this forward needs (references)
            if not s.calls:
                s.call_rng = overflow.rng_states()
            s.calls.append((module, args, dict(kwargs), autocast))
        if self.keep_overflow is not None and self.overflow_file is None:
            if s.rng is None:
                s.rng = overflow.rng_states()
            s.inputs.append(map_tensors(lambda t: t.detach(), (args, dict(kwargs))))
            s.entries.append(self._entries[id(module)])

    def _on_forward_end(self, module: nn.Module, args: Any, out: Any) -> None:
        if self._entered is module:
            self._entered = None

    def _on_output(self, i: int, module: nn.Module, args: Any, out: Any) -> None:
        if not torch.is_grad_enabled():
            return
        s = self._state or self._current()
        s.on_output(i, s.stats and i in self._stat_set, args, out)

    def _engine(self, run: Callable[..., Any], thread: int) -> Callable[..., Any]:
        def backward(roots: Any, *args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True  # noqa: F841 - the user's frames are what matter
            if threading.get_ident() != thread or not kwargs.get("accumulate_grad", True):
                return run(roots, *args, **kwargs)
            s = self._on_backward()
            out = run(roots, *args, **kwargs)
            if s is not None:
                floats = [r for r in roots
                          if isinstance(r, torch.Tensor) and r.is_floating_point()]
                if s.after_backward([r.detach() for r in floats],
                                    [id(r) in self._scaled for r in floats]):
                    s.first = (self._rerun(s), "forward")
                s.calls, s.call_rng = [], None
            return out
        return backward

    @critical
    def _rerun(self, s: StepState) -> int | None:
        """The micro-batch's forward again, with every module hooked: the first non-finite."""
        self._rerunning = True
        try:
            return rerun.first_nonfinite_module(self._model, self._modules, s.calls, s.call_rng)
        finally:
            self._rerunning = False

    def _on_backward(self) -> StepState | None:
        if not self._fresh:  # another model's backward (a copy, a GAN's other half)
            return None
        self._fresh = False
        s = self._current()
        s.micro_batches += 1
        if math.isnan(s.t0):
            s.t0 = time.perf_counter()
        return s

    def _scale(self, scale: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(outputs: Any) -> Any:
            out = scale(outputs)
            if isinstance(out, torch.Tensor):
                self._scaled.add(id(out))
            return out
        return wrapped

    def _update(self, update: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            ending = self._before_update()
            out = update(*args, **kwargs)
            self._finish(*ending)
            return out
        return wrapped

    def _before_update(self) -> tuple[float, bool]:
        """The scale the step ran at and whether the scaler skipped it; grads read if not yet."""
        scaler, s = self._scaler, self._current()
        scale = float(scaler.get_scale())
        states = scaler._per_optimizer_states
        mine = states[id(self._optimizer)] if id(self._optimizer) in states else None
        found = [v for st in ([mine] if mine else states.values())
                 for v in st["found_inf_per_device"].values()]
        skipped = bool(sum(float(v) for v in found)) if found else False
        if not s.grads_read:  # skipped: optimizer.step never ran; unscale_ did (grads unscaled)
            ready = mine is None or mine["stage"].name == "READY"
            s.read_grads(self._modules, self._stats, scale if ready else 1.0)
        if skipped and self.keep_overflow is not None and self.overflow_file is None:
            self._keep(s, scale)  # a skipped step left model and optimizer as they were
        return scale, skipped

    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        s = self._current()
        divisor = 1.0
        if self._scaler is not None:
            st = self._scaler._per_optimizer_states.get(id(optimizer))
            if st is None or st["stage"].name == "READY":  # fused: Lightning skips unscale_
                divisor = float(self._scaler.get_scale())
        s.read_grads(self._modules, self._stats, divisor)
        if self._scaler is None:
            s.grads_finite = summary.grads_finite(optimizer)
            if self.keep_overflow is not None and self.overflow_file is None and not (
                    s.grads_finite and s.first is None and math.isfinite(s.loss(None))):
                self._keep(s, None)  # before the update changes the weights
        if self._true_mode and s.stats:
            s.before = [(p, p.detach().clone(), (p.grad != 0) & torch.isfinite(p.grad))
                        for g in optimizer.param_groups for p in g["params"]
                        if p.grad is not None and p.dtype in _NARROW]

    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._scaler is None:
            self._finish(None, False)

    # ----- the step's end --------------------------------------------------------------------

    def _keep(self, s: StepState, scale: float | None) -> None:
        scaler = self._scaler.state_dict() if self._scaler is not None else None
        self.overflow_file = overflow.save(
            self.keep_overflow, step=len(self._records), inputs=s.inputs, rng=s.rng,
            entries=s.entries, autocast=s.autocast, model=self._model, optimizer=self._optimizer, scaler=scaler,
            scale=scale, loss=s.loss(scale))

    def _finish(self, scale: float | None, skipped: bool) -> None:
        s, self._state = self._current(), None
        self._scaled.clear()
        loss = s.loss(scale)
        grads_ok = s.grads_finite if s.grads_finite is not None else True
        nonfinite = skipped or not grads_ok or not math.isfinite(loss) or s.first is not None
        first, phase = s.first if s.first is not None else (None, "")
        if nonfinite and s.first is None:  # finite forward: it went non-finite in backward
            first = s.first_backward()
            if first is None:
                first = summary.nonfinite_grads(self._modules, self._stats)
            phase = "backward"
        lost = summary.lost_updates(s.before) if s.before is not None else None
        now = time.perf_counter()
        record = StepRecord(
            step=len(self._records), rank=self.rank or 0, micro_batches=s.micro_batches,
            loss=loss, scale=scale, skipped=skipped, nonfinite=nonfinite,
            first_module=self.names[first] if first is not None else "",
            first_phase=phase if nonfinite else "", lost_updates=lost,
            seconds=now - s.t0, time=time.time(),
            layers=summary.layers(s, self.names, self._stats, scale) if s.stats else ())
        self._records.append(record)
        self._arm(len(self._records) % self.every == 0)  # ready for the next step's forward
        if self._log is not None:
            write(self._log, [record])
        if self._tb is not None:
            self._tb.write(record)
        for callback in self._callbacks:
            callback(record)


@critical
def watch(model: nn.Module, optimizer: Any, scaler: Any = None, *, every: int = 1,
          log_dir: Any = None, keep_overflow: Any = None) -> Watch:
    """Record the user's own training loop per optimizer step, through hooks only.

    As a context manager, or until `close()`. See the README's "Watch a real run".
    """
    w = Watch(model, optimizer, scaler, every=every, log_dir=log_dir,
              keep_overflow=keep_overflow)
    if _interrupt._pending:  # held while it returned: close, then raise it
        w.close()
    return w


__all__ = ["Watch", "watch"]
