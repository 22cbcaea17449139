"""The doctor on every CPU class (AVX2 only, AVX512-BF16, AMX/AVX512-FP16, injected): 16-mixed in
the headline, a slow mode priced before it runs, the budget kept in plain steps, a planted fp16
overflow and its island named, and a left-out mode's row saying why. Speed is never what is
tested: a class's slow bf16 is planted in the model (SleepyOverflow)."""

from __future__ import annotations

import re

import pytest
import torch
from doctor_models import CPU_CLASSES, Plain, SleepyOverflow, data
from torch import nn

import ampnb
from ampnb.device import cpu_features_as
from ampnb.diagnosis import budget
from ampnb.diagnosis.budget import DEFAULT_STEPS
from ampnb.diagnosis.pipeline import plan

CE = nn.functional.cross_entropy
GOAL = 1.2 * DEFAULT_STEPS  # the budget holds within 1.2x, floors included


def spent_steps(report) -> float:
    """What the doctor spent, in its own accounting (plain 32-true steps measured in its run)."""
    return float(re.search(r"spent ([\d.]+) plain steps", report.budget).group(1))


@pytest.mark.parametrize("cpu", list(CPU_CLASSES))
def test_16_mixed_is_in_the_headline_on_every_cpu_class(cpu):
    with cpu_features_as(CPU_CLASSES[cpu]):
        p = plan(None, "cpu")
    head = {c.name: c for c in p.headline}
    assert "16-mixed" in head and "16-mixed" not in {c.name for c in p.emulated}
    assert "transformer-engine" in {c.name for c in p.emulated}  # FP8 stays an emulation here
    fp16 = head["16-mixed"]
    if cpu == "amx-fp16":
        assert fp16.native and not fp16.fp16_kernels
    else:  # no fp16 units: ampnb's fp16 kernels, labelled so (not filed as an emulation)
        assert fp16.fp16_kernels and not fp16.native
        assert fp16.label == "fp16 kernels" and fp16.how.startswith("fp16 kernels: ")


@pytest.fixture(scope="module", params=list(CPU_CLASSES))
def sleepy(request):
    """The default doctor on the planted model, as on each CPU class (bf16 8x slower, planted),
    after one plain AdamW step in this process (as a user's, and the benchmark's, has taken: the
    first optimizer imports torch's compiler), with the floor under the budget at 1 s (a plain
    step here is 0.5 s: the budget is the 15 steps', not the tests' 60 s floor)."""
    warm = nn.Linear(4, 4)
    opt = torch.optim.AdamW(warm.parameters())
    warm(torch.ones(1, 4)).sum().backward()
    opt.step()
    x, y = data(64)
    with pytest.MonkeyPatch.context() as mp, cpu_features_as(CPU_CLASSES[request.param]):
        mp.setattr(budget, "MIN_SECONDS", 1.0)
        return ampnb.doctor(SleepyOverflow(), (x, y), CE)


def test_the_default_budget_holds_with_a_slow_bf16(sleepy):
    assert spent_steps(sleepy) <= GOAL
    # bf16-mixed's step was priced (its forward on a slice) before it ran, and left out with it
    said = [x for x in sleepy.left_out if x.startswith("bf16-mixed: its step")]
    assert said and re.search(r"about [\d.]+ plain steps", said[0])
    row = sleepy.mode("bf16-mixed")
    assert not row.ran and row.how.startswith("not run: ") and "plain steps" in row.how


def test_the_default_doctor_names_a_planted_fp16_overflow_and_its_island(sleepy):
    before = sleepy.mode("16-mixed")
    assert before.ran and not before.finite and before.nonfinite_module == "up", (sleepy.budget, sleepy.left_out)
    after = sleepy.mode("16-mixed", ("up",))
    assert after.ran and after.finite
    elsewhere = sleepy.low_precision
    assert elsewhere is not None and "up" in " ".join(elsewhere.reasons + elsewhere.keep_fp32)


def test_a_left_out_mode_has_a_row_that_says_why_and_never_raises():
    r = ampnb.doctor(Plain(), data(), CE, budget=1e-6, profile=False)
    row = r.mode("16-mixed")
    assert not row.ran and "16-mixed: its step" in row.how
    assert row not in r.modes and [m.name for m in r.modes] == ["32-true"]
    r = ampnb.doctor(Plain(), data(), CE, modes=("32-true",), repeat=1, profile=False)
    assert "not asked for" in r.mode("bf16-mixed").how
    assert "no island" in r.mode("32-true", ("net.0",)).how
    with pytest.raises(ValueError, match="17-mixed"):
        r.mode("17-mixed")


def test_a_failed_16_mixed_forward_does_not_back_off_its_scale_step_after_step():
    """A loss that is inf/NaN is not a gradient overflow: no loss scale helps it, so the first
    step is not retried at half the scale (each retry a plain step of the budget)."""
    r = ampnb.doctor(SleepyOverflow(per_sample=0.0), data(), CE, modes=("32-true", "16-mixed"),
                     repeat=1, profile=False)
    row = r.mode("16-mixed")
    first = ampnb.get_mode("16-mixed").make_scaler("cpu").get_scale()
    assert not row.finite and row.skipped == 0 and row.scale == first


def test_the_shipped_floor_holds_a_small_real_model_within_its_budget(monkeypatch):
    """The floor under a budget in steps (read from the module's source: the tests raise it)
    keeps a 2.1M-parameter GRU LM (0.0237 s a plain step, measured on an AVX2 CPU) within 1.2x
    its 15 steps; at 1 s it allowed 42 steps' worth."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(budget))
    shipped = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                   and any(getattr(t, "id", "") == "MIN_SECONDS" for t in n.targets))
    monkeypatch.setattr(budget, "MIN_SECONDS", shipped)
    step = 0.0237
    assert budget.Budget.of(None).limit(step) <= GOAL * step
    assert budget.Budget.of(None).limit(1e-3) == shipped  # a toy model's step: the floor


def test_the_avx2_class_by_its_variables_is_what_ampnbs_detection_sees():
    """ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2 make any x86 CPU run as the AVX2
    class: ampnb then sees no AVX512/AMX units (bf16 and fp16 not native), as on that CPU."""
    import os
    import subprocess
    import sys

    code = ("from ampnb.cpu import cpu_native, detected_features; "
            "print(cpu_native('bf16'), cpu_native('fp16'), "
            "sorted(f for f in detected_features() if f.startswith(('avx512', 'amx'))))")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True).stdout.split("\n")[0]
    assert out == "False False []"


def test_the_advice_for_elsewhere_names_16_mixeds_islands():
    """bf16-mixed holds on the planted model; 16-mixed holds with `up` in fp32. The low-precision
    advice (here or where the mode has native units) names both, as the report's text shows."""
    import math

    from doctor_models import ForwardOverflow

    r = ampnb.doctor(ForwardOverflow(), data(), CE, modes=("32-true", "bf16-mixed", "16-mixed"),
                     repeat=1, profile=False, budget=math.inf)
    assert r.mode("16-mixed", ("up",)).finite and r.mode("bf16-mixed").finite
    low = r.low_precision
    assert low.mode == "bf16-mixed"
    line = next(x for x in low.reasons if x.startswith("16-mixed + keep_fp32(up)"))
    assert line in repr(r)


def test_later_modes_probes_leave_a_broken_modes_islands_their_time(monkeypatch):
    """A true mode is priced by forwards on a slice; those forwards are work too. Once a mixed
    mode broke, they run only where they fit beside the time held for its islands: the islands
    stage starts with that time left (bf16 7x slower, planted: a probe forward of bf16-true just
    under a plain step, so three of them used to run before the islands)."""
    from ampnb.diagnosis import pipeline
    from ampnb.diagnosis.headline import ISLANDS_STEPS

    seen = {}
    stage = pipeline.islands_stage

    def spy(setup, p, head, found, s, clock):
        seen["left"] = clock.left / clock.plain
        return stage(setup, p, head, found, s, clock)

    monkeypatch.setattr(pipeline, "islands_stage", spy)
    monkeypatch.setattr(budget, "MIN_SECONDS", 1.0)
    with cpu_features_as(CPU_CLASSES["avx2"]):
        r = ampnb.doctor(SleepyOverflow(bf16_slowdown=7.0), data(64), CE, profile=False)
    assert seen["left"] >= ISLANDS_STEPS, (seen, r.left_out)
    assert r.mode("16-mixed").nonfinite_module == "up" and r.mode("16-mixed", ("up",)).finite


def test_a_slow_modes_probe_is_stopped_where_the_mode_could_no_longer_fit(monkeypatch):
    """bf16 30x slower (planted, slept in 8 naps): one forward on a slice of the batch would take
    about 3.7 plain steps. The probe stops it where the mode could no longer fit what is left
    (at most a few times 32-true's sliced forward), says so, and the budget holds."""
    from doctor_models import SLEPT

    monkeypatch.setattr(budget, "MIN_SECONDS", 1.0)
    SLEPT.clear()
    with cpu_features_as(CPU_CLASSES["avx2"]):
        r = ampnb.doctor(SleepyOverflow(bf16_slowdown=30.0, overflow=False, pieces=8), data(64), CE,
                         profile=False)
    said = [x for x in r.left_out if x.startswith("bf16-mixed: its step")]
    assert said and "stopped past about" in said[0], r.left_out
    plain = 0.5  # seconds: a plain step's planted sleep
    assert SLEPT.get(torch.bfloat16, 0.0) <= 2 * plain, (SLEPT, r.left_out)
    assert spent_steps(r) <= GOAL
    assert not r.mode("bf16-mixed").ran and "stopped past" in r.mode("bf16-mixed").how


def test_a_first_step_slower_than_its_slice_priced_it_is_stopped(monkeypatch):
    """bf16 30x slower on the whole batch only (planted): its probe on a slice prices it as
    cheap, so its first step starts; its forward is stopped where the step passes what it could
    take (not the 15 s it would take), the report says so, and the budget holds."""
    from doctor_models import SLEPT

    monkeypatch.setattr(budget, "MIN_SECONDS", 1.0)
    SLEPT.clear()
    with cpu_features_as(CPU_CLASSES["avx2"]):
        r = ampnb.doctor(SleepyOverflow(bf16_slowdown=30.0, overflow=False, pieces=60,
                                        whole_batch_only=True), data(64), CE, profile=False)
    said = [x for x in r.left_out if x.startswith("bf16-mixed: its step")]
    assert said and "its first step was stopped" in said[0], r.left_out
    # at most what was left of the budget's 13.5 planned plain steps (0.5 s each), where the
    # whole forward sleeps 15 s (priced as cheap, it may take all of that in its forward)
    assert SLEPT.get(torch.bfloat16, 0.0) <= 13.5 * 0.5, (SLEPT, r.left_out)
    assert spent_steps(r) <= GOAL
    assert not r.mode("bf16-mixed").ran


def test_a_first_step_whose_backward_is_slow_is_stopped_in_its_backward(monkeypatch):
    """bf16 30x slower in the backward only, on the whole batch only (planted): neither the
    probe nor the forward shows it; the backward is stopped where the step passes what it could
    take (not the 15 s it would sleep), said so, and the budget holds."""
    from doctor_models import SLEPT

    monkeypatch.setattr(budget, "MIN_SECONDS", 1.0)
    SLEPT.clear()
    with cpu_features_as(CPU_CLASSES["avx2"]):
        r = ampnb.doctor(SleepyOverflow(bf16_slowdown=30.0, overflow=False, pieces=60,
                                        whole_batch_only=True, slow_backward=True),
                         data(64), CE, profile=False)
    said = [x for x in r.left_out if x.startswith("bf16-mixed: its step")]
    assert said and "its first step was stopped" in said[0], r.left_out
    # what was left of the budget's 13.5 planned plain steps (0.5 s each) at most, where the
    # whole backward sleeps 14.5 s
    assert SLEPT.get(torch.bfloat16, 0.0) <= 13.5 * 0.5, (SLEPT, r.left_out)
    assert spent_steps(r) <= GOAL
