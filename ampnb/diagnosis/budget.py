"""The doctor's time budget: plain training steps (default 15) or seconds, spent in a stated order."""

from __future__ import annotations

import contextlib
import math
import numbers
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass

DEFAULT_STEPS = 15
SAFETY = 1.25  # estimates are rough (a shared machine, a mode's first step): stay under the budget
# A budget in steps is counted in a unit timed on two steps of a copy, which can be a tenth off
# the user's own step (a shared machine, fresh pages): the doctor plans to end by this share of it
AIM = 0.9
# A budget in steps is at least this: on a toy model a step is a millisecond, less than the
# doctor's own set-up of one run. Small, so that it holds no real model's budget above 1.2x
# (at 1 s a 2.1M-parameter GRU LM, 0.024 s a step, could spend 69 plain steps).
MIN_SECONDS = 0.25
ORDER = ("the 32-true reference step and two plain steps after it (the budget's unit)",
         "each mixed mode's step", "timing", "fp32 islands", "true modes' steps and multi-step checks",
         "the fp64 check", "profiles")
_STEPS = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*steps?\s*$")


@dataclass(frozen=True)
class Budget:
    """How long the doctor may run: `steps` plain training steps, or `seconds` (inf: no limit)."""

    steps: float | None = DEFAULT_STEPS
    seconds: float | None = None

    @classmethod
    def of(cls, value: object) -> Budget:
        """None (15 plain steps), a number of seconds, '20 steps', or math.inf (no limit)."""
        if value is None:
            return cls()
        if isinstance(value, Budget):
            return value
        if isinstance(value, numbers.Real) and not isinstance(value, bool) and value > 0:
            return cls(None, float(value))
        found = _STEPS.match(value) if isinstance(value, str) else None
        if found and float(found.group(1)) > 0:
            return cls(float(found.group(1)), None)
        raise ValueError(f"budget={value!r} is not allowed; allowed: a number of seconds, "
                         f"'N steps' (plain training steps), math.inf (no limit), or None "
                         f"({DEFAULT_STEPS} steps)")

    def limit(self, plain_step: float) -> float:
        """The budget in seconds, given the measured plain step."""
        return self.seconds if self.seconds is not None else max(self.steps * plain_step,
                                                                  MIN_SECONDS)

    def aim(self, plain_step: float) -> float:
        """When the doctor plans to end: the limit, or AIM of it where the limit is in steps
        (above the floor), whose unit is itself measured."""
        limit = self.limit(plain_step)
        return limit if self.seconds is not None or limit <= MIN_SECONDS else max(
            AIM * limit, MIN_SECONDS)

    def describe(self, plain_step: float) -> str:
        """'15 plain steps = 12.3 s (a plain 32-true step: 0.82 s)'."""
        if self.seconds is not None and math.isinf(self.seconds):
            return f"no limit (a plain 32-true step: {plain_step:.3g} s)"
        head = (f"{self.seconds:g} s" if self.seconds is not None
                else f"{self.steps:g} plain steps = {self.steps * plain_step:.3g} s" + (
                    f", at least {MIN_SECONDS:g} s" if self.steps * plain_step < MIN_SECONDS
                    else f", planned to end by {self.aim(plain_step):.3g} s"))
        return f"{head} (a plain 32-true step: {plain_step:.3g} s)"


class Clock:
    """Time spent since the doctor started against the budget; what did not fit, and why."""

    def __init__(self, budget: Budget) -> None:
        self.budget, self.t0 = budget, time.perf_counter()
        self.plain = math.nan
        self.reserve = 0.0  # seconds kept for after the last stage (the user's state put back)
        self.left_out: list[str] = []

    @property
    def spent(self) -> float:
        return time.perf_counter() - self.t0

    @property
    def left(self) -> float:
        """Seconds left until the aim (inf until the plain step is measured, or with no limit)."""
        return math.inf if math.isnan(self.plain) else self.budget.aim(self.plain) - self.spent

    @property
    def left_to_limit(self) -> float:
        """Seconds left until the budget's limit itself, past the aim: the deadline of the work
        the headline must do (its modes' first steps and first timed round), never of the rest."""
        return math.inf if math.isnan(self.plain) else self.budget.limit(self.plain) - self.spent

    @property
    def hand(self) -> float:
        """Seconds kept in hand: one plain step and the `reserve` for what runs after the last
        stage (the report, putting the user's state back)."""
        return (0.0 if math.isnan(self.plain) else self.plain) + self.reserve

    def holds(self, seconds: float, must: bool = False) -> bool:
        """Whether work estimated at `seconds` (SAFETY over it) fits with `hand` kept, before the
        aim, or before the limit where the headline `must` do it."""
        return SAFETY * seconds + self.hand <= (self.left_to_limit if must else self.left)

    def fits(self, seconds: float, what: str) -> bool:
        """Whether work estimated at `seconds` fits before the aim (`holds`); when not, it is
        listed as left out."""
        if self.holds(seconds):
            return True
        self.left_out.append(f"{what} (about {self._steps(seconds)}; "
                             f"{self._steps(max(self.left, 0.0))} left)")
        return False

    @contextlib.contextmanager
    def held(self, seconds: float) -> Iterator[None]:
        """`seconds` kept in hand for a later stage while the work inside runs (it fits in the
        rest or is left out)."""
        self.reserve += seconds
        try:
            yield
        finally:
            self.reserve -= seconds

    def skip(self, what: str, why: str = "did not fit the budget") -> None:
        """List work that was left out."""
        self.left_out.append(f"{what} ({why})")

    def _steps(self, seconds: float) -> str:
        return f"{seconds / self.plain:.1f} plain steps" if self.plain > 0 else f"{seconds:.2g} s"

    def summary(self) -> str:
        """'spent 14.2 of 15 plain steps (11.7 s; a plain 32-true step: 0.82 s)'."""
        return (f"budget {self.budget.describe(self.plain)}; spent {self._steps(self.spent)} "
                f"({self.spent:.3g} s); order: {', '.join(ORDER)}")
