"""The doctor's report: verdict first, then evidence per mode and per layer, as data and tables."""

from __future__ import annotations

import base64
import html
import math
from dataclasses import dataclass, field
from typing import Any

from ampnb.diagnosis.candidates import TF32
from ampnb.diagnosis.evidence import ModeRow
from ampnb.diagnosis.layers import LayerRow
from ampnb.diagnosis.profile import Profile
from ampnb.diagnosis.recommend import Recommendation, Tolerance
from ampnb.display import Table, format_bytes, format_percent, format_seconds, view
from ampnb.modes import get_mode


def _err(x: float) -> str:
    if math.isnan(x):
        return "-"
    return "inf/NaN" if math.isinf(x) else f"{x:.1e}"


def _binades(x: float) -> str:
    return "-" if math.isinf(x) or math.isnan(x) else f"{x:+.1f}"


def _seconds(row: ModeRow) -> str:
    if row.seconds_spread is None:
        return format_seconds(row.seconds)
    low, high = row.seconds_spread
    return f"{format_seconds(row.seconds)} ({format_seconds(low)}-{format_seconds(high)})"


@dataclass(frozen=True, eq=False)
class DoctorReport:
    """What `ampnb.doctor` found: `.recommended`, `.modes`, `.layers`, `.gradients`, `.profiles`."""

    device: str
    recommended: Recommendation
    elsewhere: Recommendation | None   # the best low-precision choice where it would be faster
    modes: tuple[ModeRow, ...]
    layers: tuple[LayerRow, ...]
    gradients: dict[str, dict[str, float]]   # candidate -> parameter -> relative error
    profiles: dict[str, Profile]
    skipped: tuple[str, ...]
    fp64: str
    range_notes: tuple[str, ...]
    tolerance: Tolerance
    threads: int | None = None   # torch.get_num_threads() while timing (left as the user set it)
    repeat: int = 0              # timed steps per mode, round-robin across modes
    left_out: tuple[str, ...] = ()   # work that did not fit the time budget
    budget: str = ""                 # the budget, what was spent, and the order of the work
    checks: dict[str, Any] = field(default_factory=dict)  # true mode -> its multi-step TrainCheck
    noise: float | None = None       # 32-true's step-to-step variation, measured in this run
    device_why: str = "where the model's parameters are"  # why the doctor ran on `device`
    planned: tuple[str, ...] = ()    # the modes asked for that can run here, the reference first

    def mode(self, name: str, keep: tuple[str, ...] = ()) -> ModeRow:
        """The row of a candidate (with given islands); for one that did not run, a row whose
        `how` says why ('not run: ...', `.ran` False). An unknown mode name is a ValueError."""
        name = name if name == TF32 else get_mode(name).name
        for r in self.modes:
            if r.name == name and r.keep_fp32 == tuple(keep):
                return r
        return ModeRow.not_run(name, self._why_not_run(name, tuple(keep)), tuple(keep))

    def _why_not_run(self, name: str, keep: tuple[str, ...]) -> str:
        if keep and any(r.name == name for r in self.modes):
            found = [r.label for r in self.modes if r.name == name and r.keep_fp32]
            return (f"no island ({', '.join(keep)}) was verified for {name}; verified: "
                    f"{', '.join(found) or 'none'}")
        said = [x for x in (*self.left_out, *self.skipped) if x.startswith(f"{name}: ")]
        if said:
            return "; ".join(said)
        if self.planned and name not in self.planned:
            return f"not asked for (modes: {', '.join(self.planned)})"
        return "not examined (see left_out)"

    @property
    def timing(self) -> str:
        """How the speeds were measured: steps, order, spread and threads."""
        return (f"timing: {self.repeat} steps per mode after a warm-up round, round-robin across "
                "modes (drift hits all alike); spread: interquartile range of step times "
                "(min-max under 5 steps); faster or slower only when the spreads do not overlap "
                "(under 3 steps: when the gap is larger than 32-true's step-to-step variation"
                + (f", {self.noise:.0%} here" if self.noise is not None else "") + "); "
                f"{self.threads} CPU threads (torch.get_num_threads(), as set)")

    @property
    def verdict(self) -> str:
        """The recommendation and its reasons, then the low-precision choice for elsewhere."""
        lines = [f"On {self.device} ({self.device_why}): use {self.recommended.headline}"]
        lines += [f"- {r}" for r in self.recommended.reasons]
        if self.threads is not None:
            lines.append(f"- {self.timing}")
        if self.left_out:
            lines.append(f"- not examined within the budget: {'; '.join(self.left_out)}")
        if self.elsewhere is not None:
            lines.append(f"Where {self.elsewhere.mode} has native units (e.g. a recent GPU): "
                         f"{self.elsewhere.headline}")
            lines += [f"- {r}" for r in self.elsewhere.reasons[:3]]
        return "\n".join(lines)

    def table(self) -> Table:
        """Speed, memory, accuracy and range per mode."""
        rows = [(r.label, r.how.split(";")[0], _seconds(r), "-" if r is self.modes[0] else r.speed,
                 format_bytes(r.memory_bytes),
                 format_bytes(r.saved_bytes), _err(r.loss_error), _err(r.grad_error),
                 "yes" if r.finite else f"NO ({' '.join(filter(None, (r.nonfinite_phase, r.nonfinite_module)))})",
                 "-" if r.scale is None else f"2^{math.log2(r.scale):.0f}" + (
                     f" ({r.skipped} skipped)" if r.skipped else ""),
                 "-" if r.vanishing_updates is None else format_percent(r.vanishing_updates))
                for r in self.modes]
        notes = [self.fp64, *self.range_notes, *(f"not run: {s}" for s in self.skipped)]
        if self.budget:
            notes.append(self.budget)
        notes += [f"did not fit: {s}" for s in self.left_out]
        notes += [f"{name} {c.kind}: {c.summary}" for name, c in self.checks.items()]
        if self.threads is not None:
            notes.append(self.timing)
        if any(r.seconds is None for r in self.modes):
            notes.append("emulated modes are not timed: their speed here says nothing about "
                         "hardware that runs them natively")
        notes += [f"{r.label}: {r.nonfinite}" for r in self.modes if r.nonfinite]
        notes += [f"{r.label}: at the GradScaler's initial scale, {r.first_overflow}"
                  for r in self.modes if r.first_overflow]
        notes += [f"why {name}: {p.why}" for name, p in self.profiles.items()]
        return Table(("mode", "runs here", "median step (spread)", "vs 32-true (spread)",
                      "memory", "saved for bwd",
                      "loss err", "grad err", "finite", "loss scale", "vanishing updates"), rows,
                     caption=f"evidence per mode on {self.device} (errors relative to 32-true; "
                             f"tolerance loss {self.tolerance.loss:g}, gradients "
                             f"{self.tolerance.grad:g})", notes=notes)

    def layers_table(self, limit: int | None = 40) -> Table:
        """Per module: reference amax, headroom per format, end-to-end and local error."""
        names = [r.name for r in self.modes[1:] if not r.keep_fp32]
        local = [n for n in names if any(n in lr.local for lr in self.layers)]
        fmts = list(self.layers[0].headroom) if self.layers else []
        rows = []
        for lr in self.layers[:limit]:
            rows.append((lr.module, lr.kind, f"{lr.amax:.3g}",
                         *(_binades(lr.headroom[f]) for f in fmts),
                         *(lr.end_to_end[n].text if n in lr.end_to_end else "-" for n in names),
                         *(lr.local[n].text if n in lr.local else "-" for n in local)))
        heads = ("module", "type", "amax (fp32)", *(f"headroom {f}" for f in fmts),
                 *(f"end-to-end {n}" for n in names), *(f"local {n}" for n in local))
        more = len(self.layers) - len(rows)
        notes = ["headroom: binades between the module's largest fp32 output and the format's max "
                 "(negative: it overflows); errors: relative L2 (SQNR); local: the module alone "
                 "in the mode on the reference's fp32 inputs"]
        if more > 0:
            notes.append(f"... {more} more modules in report.layers")
        return Table(heads, rows, caption="per layer, in the order they ran", notes=notes)

    def gradients_table(self, limit: int = 5) -> Table:
        """Per mode, the parameters whose gradients differ most from 32-true's."""
        rows = []
        for name, errs in self.gradients.items():
            worst = sorted(errs.items(), key=lambda kv: -kv[1] if kv[1] == kv[1] else 0)[:limit]
            rows += [(name, p, _err(e)) for p, e in worst]
        return Table(("mode", "parameter", "gradient rel err"), rows,
                     caption=f"largest gradient errors per parameter (top {limit} per mode)")

    def __repr__(self) -> str:
        return "\n\n".join([self.verdict, repr(self.table()), repr(self.layers_table()),
                             repr(self.gradients_table())])

    def _repr_html_(self) -> str:
        rec = self.recommended
        parts = [f"<h4>ampnb.doctor: use {html.escape(rec.headline)}</h4><ul>"
                 + "".join(f"<li>{html.escape(r)}</li>" for r in rec.reasons) + "</ul>"]
        if self.elsewhere is not None:
            parts.append(f"<p>Where it has native units: <b>{html.escape(self.elsewhere.headline)}"
                         "</b></p>")
        shown = self.elsewhere if rec.mode == "32-true" and self.elsewhere else rec
        parts.append(f"<details><summary>code ({html.escape(shown.headline)})</summary><pre>"
                     f"{html.escape(shown.code)}</pre></details>")
        parts += [self.table()._repr_html_(), self.layers_table()._repr_html_(),
                  self.gradients_table()._repr_html_()]
        png = self._plot_png()
        if png:
            parts.append(f'<img src="data:image/png;base64,{png}"/>')
        return "".join(parts)

    def plot(self, mode: str | None = None, ax: Any = None) -> Any:
        """Per-layer headroom and local error (matplotlib Axes; see ampnb.plots.doctor)."""
        return view("doctor.layers")(self, mode, ax)

    def _plot_png(self) -> str:
        """The per-layer plot as base64 PNG (empty when matplotlib is absent)."""
        try:
            plot_layers = view("doctor.layers")
        except ImportError:
            return ""
        ax = plot_layers(self)
        return base64.b64encode(ax.figure._repr_png_()).decode()

    def show_code(self) -> str:
        """The code of the recommendation (or of the low-precision choice for elsewhere)."""
        return (self.elsewhere or self.recommended).code if self.recommended.mode == "32-true" \
            else self.recommended.code

    @property
    def low_precision(self) -> Recommendation | None:
        """The best low-precision choice for accuracy, whether or not it is faster here."""
        return self.recommended if self.recommended.mode != "32-true" else self.elsewhere

