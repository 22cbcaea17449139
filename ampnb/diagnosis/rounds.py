"""The headline's timing: round-robin steps of 32-true and the modes beside it on their working
copies, as many rounds as the budget holds.

The rounds are priced from the modes' first steps before they start; then each step starts only
where it still fits at the pace seen so far (the slowest step over its price). A machine that
got busier, or steps slower than the first ones, stop the timing between two steps (never
inside one), and the report names the timed steps that did not fit. The first round of the
modes that always run may take the time up to the budget's limit (steps under FLOOR always
start); the rest, up to its aim.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch

from ampnb.diagnosis.budget import Clock
from ampnb.diagnosis.candidates import Candidate
from ampnb.diagnosis.deadline import FLOOR
from ampnb.diagnosis.run import Setup, _timed, keeps_model


def _which(first: int, last: int) -> str:
    """'step 2', 'steps 2-3' (1-based, inclusive)."""
    return f"step {first}" if first == last else f"steps {first}-{last}"


def _kept(timed: list[Candidate], est: dict[str, float], sure: Collection[str], clock: Clock
          ) -> list[Candidate]:
    """32-true and the modes whose steps fit one round beside it, the dearest left out first
    (said so); those that always run (`sure`) are kept: their steps are checked one by one."""
    kept = sorted(timed[1:], key=lambda c: (c.name in sure, -est[c.name]), reverse=True)
    while kept and kept[-1].name not in sure and \
            not clock.holds(sum(est[c.name] for c in (timed[0], *kept))):
        c = kept.pop()
        clock.skip(f"timing {c.name} beside 32-true", f"about {est[c.name] / clock.plain:.1f} "
                   "plain steps a round; its errors are from its first step")
    return [timed[0], *(c for c in timed[1:] if c in kept)]


def _rounds_held(timed: list[Candidate], est: dict[str, float], clock: Clock, repeat: int) -> int:
    """How many rounds (at least one, at most `repeat`) the aim holds at the rounds' price;
    the steps of those past it are said to not fit."""
    total = sum(est[c.name] for c in timed)
    rounds = repeat
    while rounds > 1 and not clock.holds(rounds * total):
        rounds -= 1
    if rounds < repeat:
        clock.skip(f"timed {_which(rounds + 1, repeat)} of "
                   f"{', '.join(c.name for c in timed[1:])} beside 32-true")
    return rounds


def _stopped(timed: list[Candidate], est: dict[str, float], clock: Clock, at: tuple[int, int],
             rounds: int, pace: float, must: bool) -> None:
    """Say which timed steps did not fit, at the pace of the steps so far, from round `at[0]`'s
    step of timed[at[1]] on (32-true's steps are no mode's: they are not named)."""
    r, i = at
    left = clock.left_to_limit if must else clock.left
    why = (f"at the pace of the steps so far, about {pace * sum(est.values()) / clock.plain:.1f} "
           f"plain steps a round; {max(left, 0.0) / clock.plain:.1f} plain steps left")
    now = [c.name for c in timed[max(i, 1):]]
    if now:
        clock.skip(f"timed {_which(r + 1, rounds)} of {', '.join(now)} beside 32-true", why)
    done = [c.name for c in timed[1:i]]  # timed in this round: the later rounds did not fit
    if done and r + 1 < rounds:
        clock.skip(f"timed {_which(r + 2, rounds)} of {', '.join(done)} beside 32-true", why)


def timed_rounds(setup: Setup, timed: list[Candidate], copies: dict, bound_at: dict,
                 est: dict[str, float], sure: Collection[str], clock: Clock, repeat: int,
                 say: Callable[[str], None]) -> dict[str, list[float]]:
    """Up to `repeat` round-robin rounds of 32-true (timed[0]) and the modes whose steps fit one
    round beside it; each step started only where it fits at the pace seen so far (the first
    round of the `sure` modes, which always run, before the budget's limit; the rest before its
    aim). `est`: each step's price in seconds (32-true's the plain step, a mode's its first
    step's)."""
    timed = _kept(timed, est, sure, clock)
    if len(timed) < 2:
        return {}
    est = {c.name: est[c.name] for c in timed}
    rounds = _rounds_held(timed, est, clock, repeat)
    say(f"timing {len(timed)} modes round-robin ({rounds} steps each, "
        f"{torch.get_num_threads()} threads)")
    return _steps(setup, timed, copies, bound_at, est, sure, clock, rounds)


def _steps(setup: Setup, timed: Sequence[Candidate], copies: dict, bound_at: dict,
           est: dict[str, float], sure: Collection[str], clock: Clock, rounds: int
           ) -> dict[str, list[float]]:
    """The rounds' steps, each checked against its deadline before it starts (32-true's with
    the next mode's step: it is timed only beside one); a step of the first round that must run
    priced under FLOOR (a toy model's milliseconds) always starts: the headline has its speeds."""
    times: dict[str, list[float]] = {c.name: [] for c in timed}
    pace = 1.0  # the slowest step so far over its price: a machine that got busier shows here
    for r in range(rounds):
        for i, c in enumerate(timed):
            beside = timed[1] if i == 0 else c
            price = est[c.name] + (est[beside.name] if i == 0 else 0.0)
            must = r == 0 and beside.name in sure
            if not clock.holds(pace * price, must) and not (must and pace * price <= FLOOR):
                _stopped(list(timed), est, clock, (r, i), rounds, pace, must)
                return times
            net, opt = copies["fp32" if keeps_model(c) else c.name]
            p = bound_at.get(c.name) or c.bound()  # 32-true: no scaler
            _timed(setup, c, net, opt, p, times[c.name])
            pace = max(pace, times[c.name][-1] / max(est[c.name], 1e-9))
    return times
