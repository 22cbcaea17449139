"""The doctor's budget (plain training steps or seconds, a stated order, what did not fit) and its
memory (figures kept per mode, tensors dropped; comparisons stream against the reference's)."""

from __future__ import annotations

import math

import pytest
import torch
from doctor_models import Embedded, Plain, data, token_data
from torch import nn

import ampnb
from ampnb.batch import as_batch
from ampnb.diagnosis import budget as budget_module
from ampnb.diagnosis.budget import DEFAULT_STEPS, Budget
from ampnb.diagnosis.candidates import candidates
from ampnb.diagnosis.errors import compare
from ampnb.diagnosis.run import Setup, measure
from ampnb.start import started

CE = nn.functional.cross_entropy


def test_budget_spellings_and_bad_values():
    assert Budget.of(None) == Budget(DEFAULT_STEPS, None)
    assert Budget.of(30) == Budget(None, 30.0) and Budget.of("20 steps") == Budget(20.0, None)
    assert Budget.of(math.inf).limit(1.0) == math.inf
    assert Budget.of(None).limit(0.001) == budget_module.MIN_SECONDS  # a toy model's step
    assert Budget.of(None).limit(10.0) == DEFAULT_STEPS * 10.0
    for bad in (0, -1, True, "fast", "0 steps", [15]):
        with pytest.raises(ValueError, match="budget=.* is not allowed; allowed: a number of"):
            Budget.of(bad)


def test_a_budget_that_holds_only_the_reference_lists_the_rest_as_not_fitting():
    r = ampnb.doctor(Plain(), data(), CE, budget=1e-6, profile=True)
    assert [m.name for m in r.modes] == ["32-true"]
    said = " ".join(r.left_out)
    for name in ("bf16-mixed", "16-mixed", "bf16-true", "16-true", "the fp64 check"):
        assert name in said
    assert r.recommended.mode == "32-true"
    assert "not examined within the budget" in r.verdict and "budget 1e-06 s" in r.budget


def test_a_true_mode_is_not_recommended_from_one_step_when_its_check_does_not_fit():
    """Embedded under AdamW in bf16-true: acceptable on one step; its multi-step check does not
    fit a budget of a few seconds' worth, so it is held, and the report says why."""
    model = Embedded()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    r = ampnb.doctor(model, token_data(), CE, optimizer=opt, modes=("32-true", "bf16-true"),
                     tolerance=1.0, profile=False, budget=math.inf)
    assert "bf16-true" in r.checks                                 # no limit: the check ran
    check = r.checks["bf16-true"]
    assert check.lost > 0.01 and check.worst[0] == "emb.weight"    # lost updates, named
    assert r.recommended.mode != "bf16-true"
    assert any("emb.weight" in x for x in r.recommended.reasons)


def test_train_false_asks_one_forward_not_a_multi_step_check():
    model = Embedded()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    r = ampnb.doctor(model, token_data(), CE, optimizer=opt, modes=("32-true", "bf16-true"),
                     tolerance=1.0, profile=False, budget=math.inf, train=False)
    check = r.checks["bf16-true"]
    assert type(check).__name__ == "InferenceCheck" and check.finite
    with pytest.raises(ValueError, match="train='yes' is not allowed"):
        ampnb.doctor(model, token_data(), CE, train="yes")


def test_bad_scheduler_and_batches_are_refused_before_any_work():
    model = Plain()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    other = torch.optim.SGD(Plain().parameters(), lr=1.0)
    with pytest.raises(ValueError, match="scheduler=StepLR is not allowed"):
        ampnb.doctor(model, data(), CE, optimizer=opt,
                     scheduler=torch.optim.lr_scheduler.StepLR(other, 1))
    with pytest.raises(ValueError, match="batches=int is not allowed"):
        ampnb.doctor(model, data(), CE, optimizer=opt, batches=3)


def _tensors(obj, seen=None) -> list[torch.Tensor]:
    """Every tensor reachable through dicts, lists, tuples and dataclass fields."""
    found = []
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        for v in obj.values():
            found += _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            found += _tensors(v)
    elif hasattr(obj, "__dataclass_fields__"):
        for k in obj.__dataclass_fields__:
            found += _tensors(getattr(obj, k))
    return found


def test_a_candidate_keeps_figures_not_tensors_and_its_errors_match_a_direct_comparison():
    """Nothing a mode's run keeps scales with modules x activations: no tensor survives it; its
    per-module errors, computed as outputs stream past the reference's (on disk), are what a
    direct comparison of the two forwards' outputs gives."""
    model = Plain()
    x, y = data()
    with started(model, None) as start:
        cands, _ = candidates(("32-true", "bf16-mixed"), "cpu")
        setup = Setup(start, as_batch((x, y), CE), CE, "cpu")
        ref = measure(setup, cands[0], reference=True)
        run = measure(setup, cands[1], ref=ref)
    assert _tensors(run) == []
    assert set(ref.grads) == {n for n, _ in model.named_parameters()}   # on disk, read back
    # the reference: the same forward by hand, fp32 and under bf16 autocast
    outs = {}

    def keep(name):
        def hook(m, a, o):
            outs.setdefault(name, o.detach().float().reshape(-1))
        return hook

    hooks = [m.register_forward_hook(keep(n)) for n, m in model.named_modules() if n]
    torch.manual_seed(0)
    model(x)
    want = dict(outs)
    outs.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)
    for h in hooks:
        h.remove()
    for name in want:
        assert run.end_to_end[name].rel == pytest.approx(compare(outs[name], want[name]).rel,
                                                         rel=1e-9)


def test_the_clock_keeps_one_plain_step_in_hand_and_lists_what_it_refuses():
    from ampnb.diagnosis.budget import Clock

    clock = Clock(Budget.of(100))
    clock.plain = 10.0
    assert clock.fits(70.0, "a stage")                 # 1.25 x 70 + 10 in hand <= ~100 left
    assert not clock.fits(75.0, "the fp64 check")      # 1.25 x 75 + 10 > 100
    assert clock.left_out == ["the fp64 check (about 7.5 plain steps; 10.0 plain steps left)"]


def test_a_budget_in_steps_is_planned_to_end_short_of_it_since_its_unit_is_measured():
    from ampnb.diagnosis.budget import AIM, Clock

    clock = Clock(Budget.of("15 steps"))
    clock.plain = 10.0                                 # 150 s, above the tests' 60 s floor
    assert clock.left <= AIM * 150.0
    assert clock.fits(98.0, "a stage")                 # 1.25 x 98 + 10 <= 135
    assert not clock.fits(102.0, "the fp64 check")     # 1.25 x 102 + 10 > 135, though < 150
    assert "planned to end by 135 s" in clock.summary()
    seconds = Clock(Budget.of(150))                    # seconds are the user's: all of them
    seconds.plain = 10.0
    assert seconds.fits(102.0, "a stage")


def test_the_fp64_check_is_left_out_when_it_would_pass_the_memory_cap(monkeypatch):
    """A 64-true step holds twice 32-true's bytes: it runs only under CAP times the process's
    peak before the doctor (the user's training), else it is listed as left out, and why."""
    from ampnb.diagnosis import memory_cap

    kw = dict(modes=("32-true",), profile=False, budget=math.inf)
    r = ampnb.doctor(Plain(), data(), CE, **kw)
    assert "32-true's own error against 64-true" in r.fp64  # this process's peak allows it
    cap = memory_cap.MemoryCap("cpu")
    assert 0 < cap.now() < cap.limit and cap.fits(0)
    monkeypatch.setattr(memory_cap, "CAP", 1e-3)
    r = ampnb.doctor(Plain(), data(), CE, **kw)
    assert "did not fit the memory cap" in r.fp64
    assert any(x.startswith("the fp64 check (needs about") and "0.001x the peak memory" in x
               for x in r.left_out)


FORWARDS = [0]  # training forwards on the whole batch, across the doctor's copies of the model


class Slowing(nn.Module):
    """A Linear, then naps: each forward sleeps `seconds` a batch of 64 (in `pieces` naps, where
    the doctor may stop a forward), `slow` times that in the training forwards on the whole
    batch after the first `after` of them (a machine that got busier, injected), `fp16_slow`
    times that in fp16 on the whole batch only (a slow fp16 kernel that a slice of the batch, as
    the doctor's probe takes, does not show). Steps of sleep: plain steps on any CPU, however
    loaded."""

    def __init__(self, seconds: float = 0.2, after: int | None = None, slow: float = 1.0,
                 fp16_slow: float = 1.0, pieces: int = 20) -> None:
        super().__init__()
        from doctor_models import Nap

        torch.manual_seed(0)
        self.lin = nn.Linear(16, 4)
        self.nap = Nap()
        self.seconds, self.after, self.slow, self.fp16_slow = seconds, after, slow, fp16_slow
        self.pieces = pieces

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        factor = x.shape[0] / 64
        if x.shape[0] > 8:
            if torch.is_grad_enabled():
                FORWARDS[0] += 1
                factor *= self.slow if self.after is not None and FORWARDS[0] > self.after else 1.0
            factor *= self.fp16_slow if h.dtype == torch.float16 else 1.0
        for _ in range(self.pieces):
            h = self.nap(h, self.seconds * factor / self.pieces)
        return h


def _spent(report) -> float:
    import re

    return float(re.search(r"spent ([\d.]+) plain steps", report.budget).group(1))


def test_the_timing_round_stops_at_its_deadline_when_steps_slow_down(monkeypatch):
    """The modes' first steps take a plain step each; from the timing round on, every step takes
    five (injected). The round priced from the first steps fits, but each of its steps is
    started only where it still fits at the pace seen so far: the round stops at the deadline,
    the budget holds within 1.2x (one step at the new pace may pass the limit: a step is never
    stopped inside; the whole round would have cost 15 plain steps), and the report names the
    timed steps that did not fit."""
    from doctor_models import CPU_CLASSES

    from ampnb.device import cpu_features_as

    monkeypatch.setattr(budget_module, "MIN_SECONDS", 1.0)
    FORWARDS[0] = 0
    # 5 training forwards before the round: 32-true's first step, the unit's 2, and each mixed
    # mode's first step (bf16 counted native on this class: both modes are timed)
    model = Slowing(after=5, slow=5.0)
    with cpu_features_as(CPU_CLASSES["avx512-bf16"]):
        r = ampnb.doctor(model, data(64), CE, modes=("32-true", "bf16-mixed", "16-mixed"),
                         tolerance=1.0, profile=False)
    assert r.mode("bf16-mixed").ran and r.mode("16-mixed").ran   # their errors: first steps
    assert FORWARDS[0] - 5 < 3, (FORWARDS, r.left_out)           # the round of 3 was cut short
    assert _spent(r) <= 1.2 * DEFAULT_STEPS, (r.budget, r.left_out)
    said = [x for x in r.left_out if x.startswith("timed step 1 of")]
    assert said and "pace" in said[0] and "plain steps left" in said[0], r.left_out


def test_a_first_step_through_fp16_kernels_is_stopped_at_the_budgets_limit(monkeypatch):
    """16-mixed 30x slower on the whole batch only (planted): its probe on a slice prices it as
    cheap, so its first step starts; it always runs, but no further than the budget's limit (it
    could take the whole budget past what was spent before it), and the report says so."""
    from doctor_models import CPU_CLASSES, SLEPT

    from ampnb.device import cpu_features_as

    monkeypatch.setattr(budget_module, "MIN_SECONDS", 1.0)
    SLEPT.clear()
    model = Slowing(fp16_slow=30.0, pieces=60)
    with cpu_features_as(CPU_CLASSES["avx2"]):
        r = ampnb.doctor(model, data(64), CE, modes=("32-true", "16-mixed"), profile=False)
    said = [x for x in r.left_out if x.startswith("16-mixed: its step")]
    assert said and "its first step was stopped" in said[0], r.left_out
    # 32-true's first step and the unit's two came first (0.2 s each): 12 plain steps were left
    assert SLEPT.get(torch.float16, 0.0) <= 0.2 * (DEFAULT_STEPS - 3), (SLEPT, r.left_out)
    assert _spent(r) <= DEFAULT_STEPS, (r.budget, r.left_out)


@pytest.mark.parametrize("at_once", [1 << 22, 700])
def test_the_fp16_underflow_note_counts_what_torchs_own_cast_flushes(monkeypatch, at_once):
    """The range note's fraction of nonzero gradient values that fp16 flushes to zero, counted
    in runs of tensors (at_once: elements scaled at a time), is what torch's own fp16 cast
    flushes, with and without the GradScaler's scale; exact zeros are not counted."""
    from ampnb.diagnosis import evidence

    monkeypatch.setattr(evidence, "SCALED_AT_ONCE", at_once)
    g = torch.Generator().manual_seed(0)
    grads = {f"p{i}": torch.randn(n, generator=g) * 2.0 ** torch.randint(-45, 0, (n,), generator=g)
             for i, n in enumerate((300, 1, 5000, 64, 2000))}
    grads["p1"].zero_()
    grads["p4"][::3] = 0.0
    for scale in (1.0, 2.0**16):
        flat = torch.cat([t.reshape(-1) for t in grads.values()])
        nonzero = flat != 0
        flushed = ((flat * scale).half() == 0) & nonzero
        want = flushed.sum().item() / nonzero.sum().item()
        assert 0 < want < 1
        assert evidence.underflow(grads, scale) == pytest.approx(want, rel=1e-12)
