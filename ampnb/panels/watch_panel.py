"""WatchPanel: a watched run's steps, scale and headroom, live in the kernel or from a log_dir."""

from __future__ import annotations

import asyncio
import html
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ipywidgets as widgets

from ampnb.panels.base import Panel
from ampnb.plots._axes import new_axes
from ampnb.plots.watch import plot_headroom, plot_records
from ampnb.scaler.records import format_scale
from ampnb.watchlog.records import HEADROOM_FORMATS, KINDS, LOG_NAME, StepRecord, read_log
from ampnb.watchlog.table import StepSummary, layers_table, loss_text, records_table, summarize

_VIEWS = ("scale and loss", "headroom")
# Redraws take at most about a twentieth of a fast loop's time: after a draw that took t seconds,
# the next waits at least _QUIET * t (a long run's redraw costs more than `interval` allows).
_QUIET = 19.0


def _interval(name: str, value: Any, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{name}={value!r} is not allowed; allowed: seconds >= 0"
                         + (" or None" if allow_none else ""))
    return float(value)


def _loop() -> asyncio.AbstractEventLoop | None:
    """The running event loop (Jupyter's kernel has one), or None (a plain script)."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class WatchPanel(Panel):
    """Status, scale/loss or headroom plot, and the step and layer tables of a watched run.

    `source` is a watch (its `.records`, redrawn on a new record at most every `interval`
    seconds and in at most about 5% of a fast loop's time; interval=0: on every record) or a log_dir another process writes (read again on
    Refresh, and every `poll` seconds while the kernel is idle, where it has an event loop).
    """

    css = "watch"

    def __init__(self, source: Any, interval: float = 0.5, poll: float | None = 2.0) -> None:
        self.interval = _interval("interval", interval)
        self.poll = _interval("poll", poll, allow_none=True)
        self.log_dir: Path | None = None
        self.watch: Any = None
        if isinstance(source, (str, Path)):
            self.log_dir = Path(source)
            if self.log_dir.exists() and not self.log_dir.is_dir():
                raise ValueError(f"source={str(source)!r} is not a directory; allowed: a watch "
                                 "or a log_dir that ampnb.watch(..., log_dir=...) writes")
        elif hasattr(source, "records") and callable(getattr(source, "on_record", None)):
            self.watch = source
        else:
            raise ValueError(f"source={type(source).__name__} is not allowed; allowed: an "
                             "ampnb.watch(...) object or a log_dir path")
        self.records: list[StepRecord] = []
        self.closed = False
        self._pending = False
        self._last_draw = -float("inf")
        self._cost = 0.0  # seconds the last redraw took
        self._handle: asyncio.Handle | asyncio.TimerHandle | None = None  # throttled redraw
        self._poll_handle: asyncio.TimerHandle | None = None
        self._seen: tuple[tuple[str, int], ...] | None = None  # log files' sizes last read
        style = {"description_width": "initial"}
        self.refresh_button = widgets.Button(description="Refresh", layout={"width": "auto"})
        self.view = widgets.ToggleButtons(options=list(_VIEWS), value=_VIEWS[0],
                                          description="plot", style=style)
        self.kind = widgets.Dropdown(options=list(KINDS), value="act", description="amax of",
                                     style=style, layout={"width": "180px"})
        self.fmt = widgets.Dropdown(options=list(HEADROOM_FORMATS), value="fp16",
                                    description="headroom to", style=style,
                                    layout={"width": "200px"})
        self.status = widgets.HTML()
        self.steps_html = widgets.HTML()
        self.layers_html = widgets.HTML()
        self._base_widgets()
        self.ax = new_axes(figsize=(7.0, 3.2))
        self.figure = self.ax.figure
        self.refresh_button.on_click(lambda _b: self.refresh())
        for w in (self.view, self.kind, self.fmt):
            w.observe(lambda _c: self._safely(lambda: None), names="value")
        self.widget = widgets.VBox([
            widgets.HBox([self.refresh_button, self.view, self.kind, self.fmt]),
            self.status, self.message, self.out, self.steps_html, self.layers_html])
        self._classes({"panel": self.widget, "plot": self.out, "status": self.status,
                       "refresh": self.refresh_button})
        self._unsubscribe: Callable[[], Any] | None = None
        if self.watch is not None:
            gone = self.watch.on_record(self._on_record)
            self._unsubscribe = gone if callable(gone) else None
        self.refresh()
        self._schedule_poll()

    # ----- updates ------------------------------------------------------------------------

    def refresh(self) -> None:
        """Read the records again (the watch's, or the log_dir's files) and redraw now."""
        if self.closed:
            return
        self._pending = False
        self._safely(self._reload)

    def _reload(self) -> str | None:
        if self.watch is not None:
            self.records = list(self.watch.records)
            return None
        assert self.log_dir is not None
        if not self.log_dir.is_dir():
            self.records = []
            return f"waiting: {self.log_dir} does not exist yet"
        self._seen = self._sizes()
        self.records = read_log(self.log_dir)
        return None

    def _on_record(self, *_: Any) -> None:
        """The watch's callback: redraw now, or once `interval` has passed since the last."""
        if self.closed:
            return
        self._pending = True
        since = time.monotonic() - self._last_draw
        # interval=0 asks for every record; else the gap also grows with the redraw's cost.
        if since >= (self.interval and max(self.interval, _QUIET * self._cost)):
            self.refresh()
            return
        loop = _loop()
        if loop is not None and self._handle is None:
            # Runs once the kernel is free again (after the loop's cell) or at the next await,
            # when no loop is slowed by it: the last records are drawn even when no record
            # comes after them.
            self._handle = loop.call_later(max(0.0, self.interval - since), self._flush)

    def _flush(self) -> None:
        self._handle = None
        if self._pending:
            self.refresh()

    def _sizes(self) -> tuple[tuple[str, int], ...]:
        assert self.log_dir is not None
        paths = [self.log_dir / LOG_NAME, *sorted(self.log_dir.glob(f"rank*/{LOG_NAME}"))]
        return tuple((str(p), p.stat().st_size) for p in paths if p.is_file())

    def _schedule_poll(self) -> None:
        loop = _loop()
        if self.log_dir is None or self.poll is None or loop is None or self.closed:
            return
        self._poll_handle = loop.call_later(self.poll, self._poll_tick)

    def _poll_tick(self) -> None:
        self._poll_handle = None
        if self.closed:
            return
        try:
            changed = self.log_dir is not None and (
                not self.log_dir.is_dir() or self._sizes() != self._seen)
        except OSError:  # a file replaced while listed: look again next time
            changed = False
        if changed:
            self.refresh()
        self._schedule_poll()

    def close(self) -> None:
        """Stop following (timers cancelled, callback off) and close the widgets."""
        if self.closed:
            return
        self.closed = True
        for h in (self._handle, self._poll_handle):
            if h is not None:
                h.cancel()
        self._handle = self._poll_handle = None
        if self._unsubscribe is not None:
            self._unsubscribe()
        for w in (self.refresh_button, self.view, self.kind, self.fmt, self.status,
                  self.steps_html, self.layers_html, self.message, self.out, self.widget):
            w.close()

    # ----- view ---------------------------------------------------------------------------

    def _refresh(self, note: str | None) -> None:
        t0 = time.perf_counter()
        steps = summarize(self.records)  # once per redraw: the table and the plot take them
        self.status.value = self._status(steps, note)
        self.steps_html.value = records_table(steps)._repr_html_()
        self.layers_html.value = layers_table(self.records)._repr_html_()
        self.kind.disabled = self.fmt.disabled = self.view.value != "headroom"
        self.figure.clear()  # the twin axis goes too; the same figure is redrawn in place
        self.ax = self.figure.add_subplot(1, 1, 1)
        if self.view.value == "headroom":
            plot_headroom(self.records, kind=self.kind.value, fmt=self.fmt.value, ax=self.ax)
        else:
            plot_records(steps, ax=self.ax)
        self._show(self.figure)
        self._cost = time.perf_counter() - t0
        self._last_draw = time.monotonic()

    def _status(self, steps: list[StepSummary], note: str | None) -> str:
        src = f"log_dir {self.log_dir}" if self.log_dir is not None else "live watch"
        fields = [f"{src}: {len(steps)} steps"]
        if steps:
            last = steps[-1]
            fields.append(f"last step {last.step}: loss {loss_text(last)}, scale "
                          + ("-" if last.scale is None else format_scale(last.scale)))
            fields.append(f"skipped {sum(bool(s.skipped) for s in steps)}, non-finite "
                          f"{sum(bool(s.nonfinite) for s in steps)}")
            first = next((s for s in steps if s.nonfinite), None)
            if first is not None:
                where = first.first_module or "module not named"
                rank = f", rank {first.first_rank}" if len(first.ranks) > 1 or \
                    first.first_rank else ""
                fields.append(f"first non-finite: step {first.step}, {where}"
                              + (f" ({first.first_phase})" if first.first_phase else "") + rank)
        body = "<br>".join(html.escape(f) for f in fields)
        if note:
            body += f"<br><i>{html.escape(note)}</i>"
        return f'<div class="ampnb-watch-status">{body}</div>'
