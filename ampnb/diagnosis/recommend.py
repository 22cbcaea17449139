"""Choosing the mode: tolerance, fp32 islands (chosen, then verified), and the recommendation."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from ampnb.diagnosis.evidence import ModeRow, acceptable
from ampnb.diagnosis.layers import LayerRow
from ampnb.diagnosis.tolerance import Tolerance  # noqa: F401 - part of this module's API
from ampnb.diagnosis.weights import narrow
from ampnb.display import format_bytes
from ampnb.modes import MODES, PrecisionMode

if TYPE_CHECKING:  # training.py imports Tolerance from here
    from ampnb.diagnosis.training import TrainCheck

SPEEDUP_MIN = 1.1   # a measurable speedup (spreads apart, see evidence.speed) must reach this too
ISLAND_MODES = {"bf16-mixed": "bf16", "16-mixed": "fp16", "bf16-true": "bf16", "16-true": "fp16"}
PREFERENCE = ("bf16-mixed", "16-mixed", "transformer-engine", "bf16-true", "16-true")
MAX_ISLANDS = 8
MAX_ROUNDS = 3
LOCAL_OUTLIER = 10.0  # a layer is sensitive when its local error is 10x the mode's median
# Modes whose optimizer steps weights stored narrower than fp32 (no fp32 master copy, as APEX
# O2 keeps): an update under half a unit in a weight's last place is lost, so one step cannot
# vouch for them in training.
TRUE_MODES = frozenset(name for name, mode in MODES.items() if narrow(mode) and
                       type(mode).master_weights is PrecisionMode.master_weights)


@dataclass(frozen=True)
class Recommendation:
    """The mode to use, modules to keep in fp32, why (with the figures), and code."""

    mode: str
    keep_fp32: tuple[str, ...]
    reasons: tuple[str, ...]
    code: str
    before: ModeRow | None = None   # the mode without islands, when islands were needed
    after: ModeRow | None = None    # the verified re-run with the islands
    tf32: bool = False

    @property
    def headline(self) -> str:
        keep = f" with {', '.join(self.keep_fp32)} kept in fp32" if self.keep_fp32 else ""
        return f"{self.mode}{' + TF32' if self.tf32 else ''}{keep}"

    def __repr__(self) -> str:
        return "\n".join([f"recommended: {self.headline}", *(f"- {r}" for r in self.reasons)])


def sites(row: ModeRow, layers: tuple[LayerRow, ...], fmt: str, grad_tol: float) -> list[str]:
    """Modules to keep in fp32: where inf/NaN appeared and leaves past the format's max; when
    the run was finite, the leaves whose local error stands out (10x the mode's median)."""
    if not row.finite:
        found = [row.nonfinite_module] if row.nonfinite_module else []
        found += [r.module for r in layers if r.leaf and r.headroom.get(fmt, math.inf) < 0]
        return [m for m in dict.fromkeys(found) if m]
    errs = [r.local[row.name].rel for r in layers if row.name in r.local
            and math.isfinite(r.local[row.name].rel)]
    if not errs:
        return []
    limit = max(grad_tol, LOCAL_OUTLIER * statistics.median(errs))
    return [r.module for r in layers if row.name in r.local and r.local[row.name].rel > limit]


@dataclass(frozen=True)
class IslandSearch:
    """How the fp32 islands were found: the causal sites grown round by round until the step
    was acceptable, then each island dropped in turn (downstream first) while it stayed so."""

    sites: tuple[str, ...]     # the verified set the growth found (before dropping any)
    tried: tuple[str, ...]     # islands whose removal was rerun, in order
    dropped: tuple[str, ...]   # removed: the step stayed finite and within tolerance without them
    reruns: int
    minimal: bool              # removing any one remaining island was verified to break the step
    stopped: str = ""          # why not verified minimal ('' when it is)

    @property
    def kept(self) -> tuple[str, ...]:
        """The islands left after dropping."""
        return tuple(m for m in self.sites if m not in self.dropped)

    @property
    def text(self) -> str:
        """One line: where the search started, what it dropped, whether the rest is 1-minimal."""
        drop = (f"dropped {', '.join(self.dropped)} (the step stays finite and within "
                f"tolerance without {'it' if len(self.dropped) == 1 else 'them'}); "
                if self.dropped else "")
        last = (f"1-minimal: removing any one of {', '.join(self.kept)} breaks the step"
                if self.minimal else f"not verified 1-minimal: {self.stopped}")
        return (f"islands from the causal sites {', '.join(self.sites)}: {drop}{last} "
                f"({self.reruns} reruns)")


@dataclass(frozen=True)
class IslandRow(ModeRow):
    """A candidate's row with verified fp32 islands, and how they were found."""

    search: IslandSearch | None = None

    @classmethod
    def of(cls, row: ModeRow, search: IslandSearch) -> IslandRow:
        return cls(**{f.name: getattr(row, f.name) for f in fields(ModeRow)}, search=search)


def _downstream_first(keep: tuple[str, ...], layers: tuple[LayerRow, ...]) -> list[str]:
    """The fixed order islands are tried in: reverse of the reference's execution order (the
    cause of an overflow is upstream of the modules its values pass through)."""
    rank = {r.module: i for i, r in enumerate(layers)}
    return sorted(keep, key=lambda m: -rank.get(m, -1))


def _enclosing(row: ModeRow, keep: tuple[str, ...], layers: tuple[LayerRow, ...]) -> list[str]:
    """The module enclosing the kept one where inf/NaN still appears: in a true mode a kept
    module's fp32 output is cast back to the narrow dtype at its boundary, so values past the
    dtype's max need the module around it (whose own output may fit) kept instead."""
    at = row.nonfinite_module
    kept = [k for k in keep if at == k or at.startswith(f"{k}.")]
    if not kept or "." not in min(kept, key=len):
        return []
    parent = min(kept, key=len).rsplit(".", 1)[0]
    return [parent] if parent in {r.module for r in layers} and parent not in keep else []


def grouped(keep: tuple[str, ...], new: list[str], called: set[str]) -> list[str]:
    """Sites over MAX_ISLANDS put under their nearest common parents (the deepest module that
    ran and holds two or more of them first: T5's `DenseReluDense` for its Linear leaves) until
    they fit, or no parent below the model itself is left to group them."""
    found = [m for m in new if m not in keep]
    while len(keep) + len(found) > MAX_ISLANDS:
        under: dict[str, int] = {}
        for m in found:
            parts = m.split(".")
            for i in range(1, len(parts)):
                under[".".join(parts[:i])] = under.get(".".join(parts[:i]), 0) + 1
        shared = [a for a, n in under.items() if n >= 2 and a in called]
        if not shared:
            break
        depth = max(a.count(".") for a in shared)  # the nearest parents, all at once
        for top in [a for a in shared if a.count(".") == depth]:
            first = next(i for i, m in enumerate(found) if m.startswith(f"{top}."))
            rest = [m for m in found if not m.startswith(f"{top}.")]
            found = rest[:first] + [top] + rest[first:]
    return found


def islands(row: ModeRow, layers: tuple[LayerRow, ...], tol: Tolerance,
            rerun: Callable[[tuple[str, ...]], ModeRow], max_reruns: int | None = None,
            notes: list[str] | None = None) -> ModeRow | None:
    """The 1-minimal verified fp32 islands (None: no fix). Grow from the causal sites round by
    round, rerunning, until the mode is acceptable; then drop each island in turn (downstream
    first) and keep it dropped while the rerun stays acceptable, until every remaining island
    was verified needed against the final set. At most `max_reruns` reruns (None: no bound);
    the row's `search` says whether minimality was verified; `notes` gets why a search found
    nothing (never silently)."""
    fmt = ISLAND_MODES.get(row.name)
    if fmt is None or acceptable(row, tol.loss, tol.grad):
        return None
    if max_reruns is not None and (isinstance(max_reruns, bool) or not isinstance(max_reruns, int)
                                   or max_reruns < 0):
        raise ValueError(f"max_reruns={max_reruns!r} is not allowed; allowed: a non-negative "
                         "integer, or None (no bound)")
    budget = math.inf if max_reruns is None else max_reruns
    runs: dict[frozenset[str], ModeRow] = {frozenset(): row}

    def run(keep: tuple[str, ...]) -> ModeRow:
        key = frozenset(keep)
        if key not in runs:
            runs[key] = rerun(keep)
        return runs[key]

    keep: tuple[str, ...] = ()
    current = row
    said = notes if notes is not None else []
    for _ in range(MAX_ROUNDS):
        new = [m for m in sites(current, layers, fmt, tol.grad) if m not in keep]
        if not new and keep and not current.finite:
            new = _enclosing(current, keep, layers)
        if not new:
            if not keep:
                said.append("no module stood out: no inf/NaN site, no leaf past the format's max, "
                            f"no leaf's local error {LOCAL_OUTLIER:g}x the mode's median")
            break
        if len(keep) + len(new) > MAX_ISLANDS:
            new = grouped(keep, new, {r.module for r in layers})
        if len(keep) + len(new) > MAX_ISLANDS:
            said.append(f"{len(keep) + len(new)} modules to keep, over the cap of {MAX_ISLANDS}, "
                        f"and no common parent below the model groups them "
                        f"({', '.join(new[:3])}, ...): the search stopped")
            break
        if len(runs) - 1 >= budget:
            break
        keep = (*keep, *new)
        current = run(keep)
        if acceptable(current, tol.loss, tol.grad):
            return _minimize(current, layers, tol, run, budget, runs)
    if not keep:
        return None
    why = ("the rerun budget ran out" if len(runs) - 1 >= budget else
           "no islands made the step finite and within tolerance")
    return IslandRow.of(current, IslandSearch(keep, (), (), len(runs) - 1, False, why))


def _minimize(found: ModeRow, layers: tuple[LayerRow, ...], tol: Tolerance,
              run: Callable[[tuple[str, ...]], ModeRow], budget: float,
              runs: dict[frozenset[str], ModeRow]) -> ModeRow:
    """Drop islands from an acceptable set while the step stays acceptable (1-minimal)."""
    keep, current = found.keep_fp32, found
    tried: list[str] = []
    dropped: list[str] = []
    needed: dict[str, frozenset[str]] = {}  # island -> the set its removal was seen to break
    minimal = False
    while True:
        todo = [m for m in _downstream_first(keep, layers) if needed.get(m) != frozenset(keep)]
        if not todo:
            minimal = True
            break
        m = todo[0]
        rest = tuple(k for k in keep if k != m)
        if frozenset(rest) not in runs:  # (without any island: the row we started from)
            if len(runs) - 1 >= budget:
                break
            tried.append(m)
        trial = run(rest)
        if acceptable(trial, tol.loss, tol.grad):
            keep, current = rest, trial
            dropped.append(m)
        else:
            needed[m] = frozenset(keep)
    search = IslandSearch(found.keep_fp32, tuple(tried), tuple(dropped), len(runs) - 1, minimal,
                          "" if minimal else f"the rerun budget ({budget:g}) ran out")
    return IslandRow.of(current, search)


def _lost(row: ModeRow) -> str:
    return (f"{row.vanishing_updates:.1%} of the weight updates 32-true makes in this step leave "
            f"the {row.name} weights unchanged (smaller than half a unit in their last place): "
            "they are lost")


def _why_not(row: ModeRow, tol: Tolerance) -> str:
    if not row.finite:
        return f"{row.label}: inf/NaN ({row.nonfinite or 'in the gradients'})"
    lost = f"; {_lost(row)}" if row.vanishing_updates else ""
    return (f"{row.label}: loss error {row.loss_error:.1e} (tolerance {tol.loss:g}), gradient "
            f"error {row.grad_error:.1e} (tolerance {tol.grad:g}){lost}")


def _speed(row: ModeRow) -> str:
    return row.speed


def _mixed_for(name: str) -> str:
    """The mixed mode computing in a true mode's dtype with fp32 weights (bf16-true: bf16-mixed)."""
    dtype = MODES[name].param_dtype
    return next(n for n, m in MODES.items() if m.is_mixed and m.autocast_dtype == dtype)


def _held(row: ModeRow, checks: Mapping[str, TrainCheck], train: bool) -> str | None:
    """Why a row acceptable on one step is not recommended: for training, a true mode without a
    passing multi-step check; for inference, a mode whose one-forward check failed (None: held
    by nothing)."""
    if not train:
        check = checks.get(row.name)
        if check is None or tuple(check.keep_fp32) != row.keep_fp32 or check.ok():
            return None
        return (f"{row.label}: not recommended for inference: one forward gives output error "
                f"{check.output.rel:.1e}, loss error {check.loss_error:.1e}"
                f"{'' if check.finite else ', inf/NaN'}")
    if row.name not in TRUE_MODES:
        return None
    check = checks.get(row.name)
    instead = f"; {_mixed_for(row.name)} keeps fp32 weights, so it loses none"
    if check is None or tuple(check.keep_fp32) != row.keep_fp32:
        return (f"{row.label}: not recommended: its multi-step check did not run (did not fit "
                f"the budget){instead}")
    if not check.ok():
        return f"{row.label}: not recommended for training: {check.summary}{instead}"
    return None


def needs_check(rows: list[ModeRow], tol: Tolerance) -> list[ModeRow]:
    """True-mode rows acceptable on one step, in preference order: the multi-step checks to run
    (`training.train_check` with the row's islands) before `choose` may recommend one."""
    found = [r for r in rows[1:] if r.name in TRUE_MODES and acceptable(r, tol.loss, tol.grad)]
    return sorted(found, key=lambda r: (PREFERENCE.index(r.name) if r.name in PREFERENCE else
                                        len(PREFERENCE), len(r.keep_fp32)))


def choose(rows: list[ModeRow], tol: Tolerance, code: Callable[[str, tuple[str, ...], bool], str],
           checks: Mapping[str, TrainCheck] | None = None, *, train: bool = True
           ) -> tuple[Recommendation, Recommendation | None]:
    """(recommendation for this machine, best low-precision choice elsewhere or None).

    For training (`train`), a true mode (TRUE_MODES) is recommended only with a passing
    multi-step check in `checks` (mode name -> TrainCheck, run with the row's islands)."""
    checks = checks or {}
    ref = rows[0]
    fine = [r for r in rows[1:] if acceptable(r, tol.loss, tol.grad)]
    held = {id(r): why for r in fine if (why := _held(r, checks, train)) is not None}
    ok = [r for r in fine if id(r) not in held]
    fast = [r for r in ok if r.native and r.measurable and r.speedup is not None
            and r.speedup >= SPEEDUP_MIN]
    lowp = [r for r in ok if r.name in PREFERENCE]
    lowp.sort(key=lambda r: (PREFERENCE.index(r.name), len(r.keep_fp32)))
    rejected = [_why_not(r, tol) for r in rows[1:] if r not in fine and not any(
        o.name == r.name for o in fine)] + list(held.values())
    best_low = _make(lowp[0], ref, rows, tol, code, checks=checks) if lowp else None
    if fast:
        pick = max(fast, key=lambda r: (r.speedup, -len(r.keep_fp32)))
        tie = _bf16_tie(pick, ok)
        made = _make(tie or pick, ref, rows, tol, code, rejected, checks)
        if tie is not None:
            made = dataclasses.replace(made, reasons=(made.reasons[0], _tie_reason(tie, pick),
                                                      *made.reasons[1:]))
        return made, (None if best_low is None or best_low.mode == made.mode else best_low)
    slow = [f"{r.label}: {_speed(r)} ({r.how})" for r in rows[1:] if r in ok]
    reasons = [f"nothing that stays within tolerance is measurably faster than 32-true on this "
               f"machine (counted: native units, at least {SPEEDUP_MIN}x, and the mode's slow end "
               "of step times below 32-true's fast end, timed round-robin)", *slow,
               *rejected]
    return (Recommendation("32-true", (), tuple(reasons), code("32-true", (), False)), best_low)


def apart(a: ModeRow, b: ModeRow) -> bool:
    """Whether two modes' step times differ measurably: their spreads do not overlap or, with
    too few steps for spreads, the gap is larger than the step-to-step variation measured."""
    if a.seconds_spread and b.seconds_spread:
        return a.seconds_spread[1] < b.seconds_spread[0] or b.seconds_spread[1] < a.seconds_spread[0]
    noise = a.noise if a.noise is not None else b.noise
    if not a.seconds or not b.seconds or noise is None:
        return False
    return abs(math.log(a.seconds / b.seconds)) > math.log1p(noise)


def _bf16_tie(pick: ModeRow, ok: list[ModeRow]) -> ModeRow | None:
    """bf16-mixed where 16-mixed won by a margin the timing cannot tell apart (None: no tie)."""
    if pick.name != "16-mixed":
        return None
    bf16 = next((r for r in ok if r.name == "bf16-mixed" and r.native and r.ratio is not None
                 and r.keep_fp32 == pick.keep_fp32), None)
    return bf16 if bf16 is not None and not apart(bf16, pick) else None


def _tie_reason(bf16: ModeRow, fp16: ModeRow) -> str:
    return (f"bf16-mixed and 16-mixed hold alike and are not measurably different in speed here "
            f"({bf16.speed} against {fp16.speed}): bf16-mixed is chosen — no GradScaler and "
            "fp32's range, as PyTorch's and Lightning's docs advise where bf16 runs natively")


def _fp16_islands(row: ModeRow, rows: list[ModeRow], tol: Tolerance) -> list[str]:
    """For another low-precision choice: 16-mixed's verified fp32 islands, where they were found
    (where fp16 has native units, the mode to run with them)."""
    if row.name == "16-mixed" or row.name not in PREFERENCE:
        return []
    return [f"{r.label}: also within tolerance (loss error {r.loss_error:.1e}, gradient error "
            f"{r.grad_error:.1e}, no inf/NaN), verified with these modules in fp32"
            for r in rows if r.name == "16-mixed" and r.keep_fp32 and acceptable(r, tol.loss,
                                                                                  tol.grad)][:1]


def _make(row: ModeRow, ref: ModeRow, rows: list[ModeRow], tol: Tolerance,
          code: Callable[[str, tuple[str, ...], bool], str], rejected: list[str] = (),
          checks: Mapping[str, TrainCheck] | None = None) -> Recommendation:
    tf32 = row.name.endswith("+tf32")
    mode = "32-true" if tf32 else row.name
    reasons = [f"{row.label}: {_speed(row)} vs 32-true ({row.how}), loss error "
               f"{row.loss_error:.1e} <= {tol.loss:g}, gradient error {row.grad_error:.1e} <= "
               f"{tol.grad:g}, no inf/NaN",
               f"memory {format_bytes(row.memory_bytes)} vs {format_bytes(ref.memory_bytes)} in "
               "32-true (parameters, gradients, optimizer state, saved for backward)"]
    reasons[1:1] = _fp16_islands(row, rows, tol)
    before = None
    if row.keep_fp32:
        before = next(r for r in rows if r.name == row.name and not r.keep_fp32)
        reasons.append(f"verified: without the islands {_why_not(before, tol)}; with them "
                       f"loss error {row.loss_error:.1e}, gradient error {row.grad_error:.1e}, "
                       f"{'no inf/NaN' if row.finite else 'still inf/NaN'}")
        search = getattr(row, "search", None)
        if search is not None:
            reasons.append(search.text)
    if row.vanishing_updates:
        reasons.append(_lost(row))
    check = (checks or {}).get(row.name)
    if check is not None and tuple(check.keep_fp32) == row.keep_fp32:
        reasons.append(f"{check.kind} {check.summary}")
    return Recommendation(mode, row.keep_fp32, (*reasons, *rejected), code(mode, row.keep_fp32, tf32),
                          before, row if row.keep_fp32 else None, tf32)
