"""The end of a watched step: what is kept of it, its figures, its record, the log."""

from __future__ import annotations

import time
import warnings

from ampnb.watcher import overflow, summary
from ampnb.watcher.hooks import StepState
from ampnb.watchlog.records import StepRecord, write


class Ending:
    """How a `Watch` ends a step (a mixin: the watch's state)."""

    _records: list[StepRecord]
    _ended: list[StepState]

    @staticmethod
    def _probe(s: StepState) -> float:
        """The step's loss plus its gradient probe: finite when both are (a read)."""
        probe = float(s.grads_probe) if s.grads_probe is not None else 0.0
        return s.loss() + probe

    # ----- the step's end --------------------------------------------------------------------

    def _keep(self, s: StepState) -> None:
        """Save the step (keep_overflow); a failure is a warning, never an error in the loop."""
        self._keeping = False  # once: kept, or failed
        self.overflow_file = overflow.keep(self.keep_overflow, s, self._model, self._optimizer,
                                           len(self._records) + len(self._ended))

    def _finish(self, skipped: bool) -> None:
        s, self._state, self._token = self._current(), None, None
        s.skipped = skipped
        s.seconds, s.time = time.perf_counter() - s.t0, time.time()
        try:
            self._summarize(s)
        except Exception as e:  # the step is recorded, incomplete; training goes on
            s.failed(e)
        s.inputs, s.out_grads, s.rng = [], [], None
        self._ended.append(s)
        if s.stats:
            self._make_records()
        self._arm(self._next_is_stats())  # ready for the next step's forward

    def _summarize(self, s: StepState) -> None:
        if self._keeping and (s.skipped or s.found_inf is not None and bool(s.found_inf)):
            self._keep(s)  # a skipped step left model and optimizer as they were
        if s.stats:
            if not s.grads_read:  # no backward seen (log_loss only)
                s.read_grads(self._modules, self._stats, 1.0)
            if s.before is not None:
                s.lost = summary.lost_updates(s.before)
            s.before = None
            s.layers = summary.layers(s, self.names, self._stats, s.scale)

    def _make_records(self) -> None:
        """The ended steps' records (their reads happen here), logged and given to callbacks."""
        ended, self._ended = self._ended, []
        for s in ended:
            try:
                record = summary.step_record(s, len(self._records), self.rank or 0, self.names,
                                             self._modules, self._stats)
            except Exception as e:  # what could be read, marked incomplete
                s.failed(e)
                record = summary.bare_record(s, len(self._records), self.rank or 0)
            self._records.append(record)
            if self._log is not None:
                self._write(record)
            for callback in self._callbacks:
                try:
                    callback(record)
                except Exception as e:  # a callback's failure ends no training either
                    self.failed(e)

    def _write(self, record: StepRecord) -> None:
        try:
            write(self._log, [record])
            if self._tb is not None:
                self._tb.write(record)
        except OSError as e:  # a full disk must not end the training
            warnings.warn(f"ampnb.watch could not write to {self.log_dir}: {e}", stacklevel=3)
