"""PrecisionMonitorCallback: ampnb.watch inside a Hugging Face Trainer, logged through the Trainer."""

from __future__ import annotations

import warnings
from typing import Any

from ampnb.integrations import metrics
from ampnb.watchlog.records import StepRecord

try:
    from transformers import Trainer, TrainerCallback
except ImportError:  # pragma: no cover - depends on what is installed
    raise ImportError("ampnb.integrations.transformers needs transformers: pip install "
                      "transformers accelerate") from None


def _runs_fp32_for_fp16(trainer: Any) -> bool:
    """fp16=True, yet Accelerate set up neither autocast nor a GradScaler (its CPU fp16)."""
    acc = trainer.accelerator
    own_autocast = type(trainer).autocast_smart_context_manager is not \
        Trainer.autocast_smart_context_manager  # a subclass may enter autocast itself
    return (bool(trainer.args.fp16) and acc.device.type == "cpu"
            and not getattr(acc, "native_amp", True) and acc.scaler is None and not own_autocast)


class PrecisionMonitorCallback(TrainerCallback):
    """Records every optimizer step of `trainer.train()` with ampnb.watch; logs ampnb/* scalars.

    A callback is not handed its Trainer, so it takes it here:
    `trainer.add_callback(PrecisionMonitorCallback(trainer))`. Scalars go through `trainer.log`
    (so report_to integrations get them) on the Trainer's logging steps and on every skipped or
    non-finite step.
    """

    def __init__(self, trainer: Any, every: int = 1, log_dir: Any = None,
                 keep_overflow: Any = None, log: bool = True) -> None:
        from ampnb.watcher.inputs import check_every, check_path

        if not isinstance(trainer, Trainer):
            raise ValueError(f"trainer={type(trainer).__name__} is not allowed; allowed: a "
                             "transformers.Trainer (the one this callback is added to)")
        if not isinstance(log, bool):
            raise ValueError(f"log={log!r} is not allowed; allowed: True or False")
        self.trainer = trainer
        self.every = check_every(every)
        self.log_dir = check_path("log_dir", log_dir)
        self.keep_overflow = check_path("keep_overflow", keep_overflow)
        self.log = log
        self.watch: Any = None
        self._pending: list[StepRecord] = []

    @property
    def records(self) -> tuple[StepRecord, ...]:
        """The records of the last train() (empty before one)."""
        return () if self.watch is None else self.watch.records

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from ampnb.watcher.core import watch

        self.close()
        trainer = self.trainer
        if _runs_fp32_for_fp16(trainer):
            warnings.warn("fp16=True on CPU: Accelerate runs no fp16 autocast and no GradScaler "
                          "here, so the model trains in fp32", stacklevel=2)
        model, optimizer = kwargs.get("model"), kwargs.get("optimizer")
        model = trainer.model if model is None else model  # (a Module's truth is its length)
        optimizer = trainer.optimizer if optimizer is None else optimizer
        self._pending = []
        # record.loss is the sum of what the Trainer's backward starts from over the step's
        # micro-batches: the loss the Trainer itself logs for that step
        self.watch = watch(model, optimizer, trainer.accelerator.scaler, every=self.every,
                           log_dir=self.log_dir, keep_overflow=self.keep_overflow)
        if self.log:
            self.watch.on_record(self._pending.append)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        pending, self._pending[:] = list(self._pending), []
        should_log = control.should_log  # set by the Trainer's flow callback, which runs first
        for record in pending:
            # the Trainer's cadence, but never a bad step lost
            if should_log or record.skipped or record.nonfinite:
                self.trainer.log(metrics(record))
        # trainer.log clears should_log: put it back, or the Trainer's own log would not happen
        control.should_log = self.trainer.control.should_log = should_log
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    def close(self) -> None:
        """Detach the watch (train() ending does it; after a train() that raised, call this)."""
        if self.watch is not None:
            self.watch.close()  # a second close does nothing

    def __enter__(self) -> PrecisionMonitorCallback:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
