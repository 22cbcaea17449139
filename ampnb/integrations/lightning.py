"""PrecisionMonitor: ampnb.watch inside a Lightning Trainer, its scalars through the Trainer's loggers."""

from __future__ import annotations

import warnings
from typing import Any

from ampnb.integrations import metrics
from ampnb.watchlog.records import StepRecord

try:  # the unified package first; the standalone one where only that is installed
    import lightning.pytorch as pl
except ImportError:
    try:
        import pytorch_lightning as pl
    except ImportError:
        raise ImportError("ampnb.integrations.lightning needs Lightning: pip install lightning "
                          "(or pytorch_lightning)") from None


def precision_scaler(trainer: Any) -> Any:
    """The GradScaler of the Trainer's precision plugin (None in bf16 and true modes)."""
    plugin = getattr(trainer, "precision_plugin", None)
    if plugin is None:  # older Trainers reach it only through the strategy
        plugin = getattr(getattr(trainer, "strategy", None), "precision_plugin", None)
    return getattr(plugin, "scaler", None)


class PrecisionMonitor(pl.Callback):
    """Records every optimizer step of `Trainer.fit` with ampnb.watch; logs ampnb/* scalars."""

    def __init__(self, every: int = 1, log_dir: Any = None, keep_overflow: Any = None,
                 log: bool = True) -> None:
        from ampnb.watcher.inputs import check_every, check_path

        # checked here, so a bad argument fails where it is written, not inside fit
        self.every = check_every(every)
        self.log_dir = check_path("log_dir", log_dir)
        self.keep_overflow = check_path("keep_overflow", keep_overflow)
        if not isinstance(log, bool):
            raise ValueError(f"log={log!r} is not allowed; allowed: True or False")
        self.log = log
        self.watch: Any = None            # the running (or last) watch
        self._pending: list[StepRecord] = []
        self._first_step = 0              # the Trainer's global step when the watch attached

    @property
    def records(self) -> tuple[StepRecord, ...]:
        """The records of the last fit (empty before one)."""
        return () if self.watch is None else self.watch.records

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # after the sanity check, so its validation forwards are not counted as a step's
        from ampnb.watcher.core import watch

        self._close()
        if not trainer.optimizers:
            raise ValueError("PrecisionMonitor needs an optimizer; allowed: a LightningModule "
                             "whose configure_optimizers returns one")
        if len(trainer.optimizers) > 1:
            warnings.warn(f"PrecisionMonitor watches the first of {len(trainer.optimizers)} "
                          "optimizers", stacklevel=2)
        self._pending = []
        self._first_step = trainer.global_step
        # record.loss: the sum of what Lightning's backward starts from (each training_step
        # loss / accumulate_grad_batches): the mean of the step's losses, as Lightning logs them
        self.watch = watch(pl_module, trainer.optimizers[0], precision_scaler(trainer),
                           every=self.every, log_dir=self.log_dir,
                           keep_overflow=self.keep_overflow)
        if self.log:
            self.watch.on_record(self._pending.append)  # logged at the batch's end, below

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._flush(trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._flush(trainer)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._flush(trainer)
        self._close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close()  # the records up to the failure stay readable in .records

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._close()

    def _flush(self, trainer: Any) -> None:
        """Give the steps recorded since the last flush to every logger, at the Trainer's step."""
        pending, self._pending[:] = list(self._pending), []
        for record in pending:
            for logger in trainer.loggers:
                logger.log_metrics(metrics(record), step=self._first_step + record.step)

    def _close(self) -> None:
        if self.watch is not None:
            self.watch.close()  # a second close does nothing
