"""The watch's records as tables: one row per step (ranks merged), and per layer at one step."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ampnb.display import Table, TableView, format_percent
from ampnb.scaler.records import format_scale
from ampnb.watchlog.records import HEADROOM_FORMATS, KINDS, LayerStats, StepRecord


@dataclass(frozen=True)
class StepSummary:
    """One optimizer step as every rank saw it (one rank: that rank's record)."""

    step: int
    ranks: tuple[int, ...]            # the ranks that recorded this step
    loss: float                       # mean over the ranks' losses (each rank's own batch)
    scale: float | None               # the lowest rank's scale (the scaler's is the same on all)
    skipped: tuple[int, ...]          # ranks whose scaler skipped optimizer.step()
    nonfinite: tuple[int, ...]        # ranks where the loss or a gradient was inf/NaN
    first_rank: int | None            # where it first became non-finite (named module, earliest time)
    first_module: str                 # ... and the module and phase it named
    first_phase: str
    lost_updates: float | None

    @property
    def has_scaler(self) -> bool:
        """A GradScaler was there to skip the step."""
        return self.scale is not None

    @property
    def eventful(self) -> bool:
        """Skipped or non-finite on some rank: a row the table never elides."""
        return bool(self.skipped or self.nonfinite)

    @property
    def skip_agrees(self) -> bool:
        """The skip was the same on every rank (GradScaler's found_inf is all-reduced)."""
        return not self.skipped or len(self.skipped) == len(self.ranks)


def _records(records: Iterable[StepRecord]) -> list[StepRecord]:
    found = list(records)
    bad = next((r for r in found if not isinstance(r, StepRecord)), None)
    if bad is not None:
        raise ValueError(f"records contain {type(bad).__name__}; allowed: ampnb.watch "
                         "StepRecords (w.records or ampnb.watchlog.read_log(log_dir))")
    return found


def _first(bad: list[StepRecord]) -> StepRecord:
    # A rank that names a module saw the inf/NaN arise there; one that names none got it
    # through the gradient all-reduce. Among those, the step that ended first (no clock last).
    # A forward overflow is the rank's own (its micro-batch made it); a backward one may be the
    # all-reduced gradients another rank sent: forward first, then the step that ended first.
    return min(bad, key=lambda r: (not r.first_module, r.first_phase != "forward",
                                   math.isnan(r.time), r.time, r.rank))


def _summary(step: int, rs: list[StepRecord]) -> StepSummary:
    rs.sort(key=lambda r: r.rank)
    bad = [r for r in rs if r.nonfinite]
    first = _first(bad) if bad else None
    return StepSummary(
        step=step, ranks=tuple(r.rank for r in rs), loss=sum(r.loss for r in rs) / len(rs),
        scale=rs[0].scale, skipped=tuple(r.rank for r in rs if r.skipped),
        nonfinite=tuple(r.rank for r in bad), first_rank=first.rank if first else None,
        first_module=first.first_module if first else "",
        first_phase=first.first_phase if first else "", lost_updates=rs[0].lost_updates)


def summarize(records: Iterable[StepRecord] | Iterable[StepSummary]) -> list[StepSummary]:
    """One StepSummary per step, in step order, the ranks' records of that step merged.

    Summaries already made are returned as they are (a panel summarizes once per redraw).
    """
    found = list(records)
    if found and all(isinstance(s, StepSummary) for s in found):
        return found
    by_step: dict[int, list[StepRecord]] = {}
    for r in _records(found):
        by_step.setdefault(r.step, []).append(r)
    return [_summary(step, by_step[step]) for step in sorted(by_step)]


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks) if ranks else "-"


def _skipped_cell(s: StepSummary, many: bool) -> str:
    if not s.has_scaler:
        return "no scaler" if s.nonfinite else "-"  # nothing was there to skip a bad step
    if not s.skipped:
        return "no"
    return "yes" if not many or s.skip_agrees else f"ranks {_ranks(s.skipped)} only"


def _nonfinite_cell(s: StepSummary) -> str:
    if not s.nonfinite:
        return "-"
    if not s.first_module:
        return "yes (module not named)"
    return f"{s.first_module} ({s.first_phase})" if s.first_phase else s.first_module


def loss_text(s: StepSummary) -> str:
    """The step's loss as shown: '-' where the watch saw none (nan on a bad step is its loss)."""
    return "-" if math.isnan(s.loss) and not s.nonfinite else f"{s.loss:.5g}"


@dataclass(frozen=True, repr=False)
class StepsTable(TableView):
    """The steps of a watched run; a long run keeps its eventful steps and its ends."""

    steps: tuple[StepSummary, ...]
    head: int = 5         # first and ...
    tail: int = 5         # ... last steps always shown
    max_events: int = 40  # skipped / non-finite steps shown at most (the rest counted)

    @property
    def multi_rank(self) -> bool:
        """Records came from more than one rank."""
        return any(r > 0 for s in self.steps for r in s.ranks)

    def shown(self) -> list[StepSummary | tuple[int, int]]:
        """The rows to show: a StepSummary, or (first, last) step of an elided stretch."""
        n = len(self.steps)
        if n <= self.head + self.tail + self.max_events:
            return list(self.steps)
        events = [i for i, s in enumerate(self.steps) if s.eventful][:self.max_events]
        keep = sorted({*range(self.head), *range(n - self.tail, n), *events})
        rows: list[StepSummary | tuple[int, int]] = []
        for a, b in zip([-1, *keep], keep):
            if b > a + 1:
                rows.append((self.steps[a + 1].step, self.steps[b - 1].step))
            rows.append(self.steps[b])
        return rows

    def table(self) -> Table:
        many = self.multi_rank
        headers = ["step", "loss", "scale", "skipped", "non-finite (first module, phase)",
                   "lost updates"]
        if many:
            headers[4:4] = ["non-finite on ranks", "first rank"]
        rows = []
        for s in self.shown():
            if isinstance(s, tuple):
                a, b = s
                rows.append([f"{a}..{b}", f"... {b - a + 1} steps elided", *[""] * (len(headers) - 2)])
                continue
            row = [s.step, loss_text(s), "-" if s.scale is None else format_scale(s.scale),
                   _skipped_cell(s, many), _nonfinite_cell(s),
                   "-" if s.lost_updates is None else format_percent(s.lost_updates)]
            if many:
                row[4:4] = [_ranks(s.nonfinite), "-" if s.first_rank is None else s.first_rank]
            rows.append(row)
        return Table(headers, rows, caption=self._caption(), notes=self._notes(many))

    def _caption(self) -> str:
        n = len(self.steps)
        skipped = sum(bool(s.skipped) for s in self.steps)
        bad = sum(bool(s.nonfinite) for s in self.steps)
        ranks = sorted({r for s in self.steps for r in s.ranks})
        where = f" on ranks {_ranks(ranks)}" if self.multi_rank else ""
        return f"watched steps{where}: {n} steps, {skipped} skipped, {bad} non-finite"

    def _notes(self, many: bool) -> list[str]:
        notes = []
        elided = [s for s in self.shown() if isinstance(s, tuple)]
        if elided:
            hidden = sum(b - a + 1 for a, b in elided)
            events = sum(s.eventful for s in self.steps)
            more = events - min(events, self.max_events)
            notes.append(f"{hidden} of {len(self.steps)} steps elided: shown are the first "
                         f"{self.head}, the last {self.tail} and the skipped or non-finite "
                         f"steps" + (f" (the first {self.max_events}; {more} more are among "
                                     "the elided)" if more else ""))
        if many:
            split = [s.step for s in self.steps if not s.skip_agrees]
            notes.append("the GradScaler's skip was the same on every rank at every step" if
                         not split else f"ranks disagree on the skip at steps {_ranks(split)}: "
                         "each rank's scaler decided alone")
            notes.append("loss: mean of the ranks' losses; first rank: of the ranks that name "
                         "the module where inf/NaN arose (in the forward before the backward, "
                         "whose gradients the all-reduce shares), the one whose step ended first")
        if any(s.nonfinite and not s.has_scaler for s in self.steps):
            notes.append("no scaler: no GradScaler was there to skip a non-finite step")
        return notes


def records_table(records: Iterable[StepRecord] | Iterable[StepSummary], *, head: int = 5, tail: int = 5,
                  max_events: int = 40) -> StepsTable:
    """One row per step (ranks merged); long runs show eventful steps plus first/last few."""
    for name, v in (("head", head), ("tail", tail), ("max_events", max_events)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name}={v!r} is not allowed; allowed: an integer >= 0")
    return StepsTable(tuple(summarize(records)), head, tail, max_events)


def _amax_cell(v: float) -> str:
    return "-" if math.isnan(v) else f"{v:.3g}"


def _headroom_cell(layer: LayerStats, fmt: str) -> str:
    def one(kind: str) -> str:
        if math.isnan(layer.amax(kind)):
            return "-"
        h = layer.headroom(kind, fmt)
        return "inf" if math.isinf(h) else f"{h:.1f}"  # amax 0: nothing to overflow
    return " / ".join(one(k) for k in KINDS)


@dataclass(frozen=True, repr=False)
class LayersTable(TableView):
    """Each layer's amax and headroom at one stats step of one rank."""

    step: int | None
    rank: int | None
    layers: tuple[LayerStats, ...]

    def table(self) -> Table:
        if self.step is None:
            return Table(("module",), [], caption="no layer statistics recorded yet",
                         notes=("the watch records them every `every` steps",))
        headers = ["module", "amax act", "amax act_grad", "amax grad",
                   *(f"headroom {f} (act / act_grad / grad)" for f in HEADROOM_FORMATS),
                   "fp16 flush"]
        rows = [[la.module, *(_amax_cell(la.amax(k)) for k in KINDS),
                 *(_headroom_cell(la, f) for f in HEADROOM_FORMATS),
                 "-" if math.isnan(la.fp16_flush) else format_percent(la.fp16_flush)]
                for la in self.layers]
        rank = f", rank {self.rank}" if self.rank else ""
        return Table(headers, rows, caption=f"layers at step {self.step}{rank}: amax (unscaled) "
                     "and headroom in binades to each format's max (negative: overflows)",
                     notes=("fp16 flush: share of nonzero parameter gradients fp16 rounds to "
                            "zero without a loss scale",))


def layers_table(records: Iterable[StepRecord], step: int | None = None,
                 rank: int | None = None) -> LayersTable:
    """Per layer at the last stats step (or `step`), of the lowest rank (or `rank`)."""
    stats = [r for r in _records(records) if r.layers]
    if rank is not None:
        have = sorted({r.rank for r in stats})
        stats = [r for r in stats if r.rank == rank]
        if not stats and have:
            raise ValueError(f"rank={rank!r} has no layer statistics; allowed: one of {have}")
    if step is not None:
        found = [r for r in stats if r.step == step]
        if not found:
            have = sorted({r.step for r in stats})
            raise ValueError(f"step={step!r} has no layer statistics; allowed: one of "
                             f"{have[:10]}{' ...' if len(have) > 10 else ''}")
        stats = found
    if not stats:
        return LayersTable(None, rank, ())
    last = max(r.step for r in stats)
    r = min((r for r in stats if r.step == last), key=lambda r: r.rank)
    return LayersTable(r.step, r.rank, r.layers)
