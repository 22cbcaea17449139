"""The doctor benchmark's harness: what a child process reports and how rows are derived from it."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks._procs import MARK, Measurement, _said, _short, command, parse
from benchmarks.bench_doctor import MEMORY_GOAL, NOISY, STEPS_GOAL, doctor_rows, judged_rows

ROOT = Path(__file__).resolve().parents[1]
TRAIN = Measurement("train", "gpt2-17M", 1, 16_840_704, 0.38, 0.37, 780.0)
DOCTOR = Measurement("doctor", "gpt2-17M", 1, 16_840_704, 16.0, 15.0, 3060.0, step_seconds=0.4,
                     step_cpu_seconds=0.36, step_low=0.38, step_high=0.45, headline="bf16-mixed",
                     not_fit="bf16-true multi-step check", budget="budget 15 steps, spent 15",
                     most_time="timing 1.0 s")


def _run_child(kind: str, threads: int) -> tuple[Measurement, float]:
    """A child's own report, and its peak RSS in MiB as the kernel accounted it (wait4)."""
    proc = subprocess.Popen(command(kind, "tiny", threads), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "3"})
    out, err = proc.stdout.read(), proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    proc.stdout.close()
    proc.stderr.close()
    assert proc.returncode == 0, err
    return parse(out), usage.ru_maxrss / 1024


def test_parse_takes_the_last_result_line_among_other_output():
    stale = replace(DOCTOR, seconds=99.0)
    text = "\n".join(["ampnb.doctor: timing", MARK + json.dumps(asdict(stale)), "noise",
                      MARK + json.dumps(asdict(DOCTOR)), "USDT: profiler_stop"])
    assert parse(text) == DOCTOR
    with pytest.raises(ValueError, match="no RESULT line.*Traceback"):
        parse("starting\nTraceback (most recent call last)")


def test_rows_judge_the_ratios_of_the_two_processes():
    time_row, memory_row = doctor_rows("GPT-2 17M", TRAIN, DOCTOR)
    # Time: in the plain steps timed beside the doctor; memory: against the process that only trains.
    assert time_row.ratio == pytest.approx(DOCTOR.seconds / DOCTOR.step_seconds)
    assert memory_row.ratio == pytest.approx(DOCTOR.peak_mib / TRAIN.peak_mib)
    assert time_row.ok is (DOCTOR.seconds / DOCTOR.step_seconds <= STEPS_GOAL)
    assert memory_row.ok is (DOCTOR.peak_mib / TRAIN.peak_mib <= MEMORY_GOAL)
    assert "1 thread" in time_row.name and "16.8M params" in time_row.name
    assert all(said in time_row.figure for said in (DOCTOR.not_fit, DOCTOR.headline, DOCTOR.budget))
    assert f"CPU time {DOCTOR.cpu_seconds / DOCTOR.step_cpu_seconds:.1f} steps" in time_row.figure
    at_goal = replace(DOCTOR, seconds=DOCTOR.step_seconds * STEPS_GOAL,
                      cpu_seconds=DOCTOR.step_cpu_seconds * STEPS_GOAL, peak_mib=TRAIN.peak_mib,
                      not_fit="")
    fits = doctor_rows("GPT-2 17M", TRAIN, at_goal)
    assert [r.ok for r in fits] == [True, True] and "did not fit" not in fits[0].figure


def test_a_time_row_is_not_judged_when_the_plain_steps_around_it_vary_too_much():
    wide = replace(DOCTOR, step_low=0.3, step_high=0.3 * NOISY * 1.01)
    time_row, memory_row = doctor_rows("GPT-2 17M", TRAIN, wide)
    assert time_row.ok is None and "not judged" in time_row.figure
    assert memory_row.ok is not None  # peak memory does not depend on the load
    edge = replace(DOCTOR, step_low=0.3, step_high=0.3 * NOISY)
    assert doctor_rows("GPT-2 17M", TRAIN, edge)[0].ok is not None


@pytest.mark.parametrize("factor", [1 / (NOISY * 1.01), NOISY * 1.01])
def test_a_time_row_is_not_judged_when_the_load_changed_while_the_doctor_ran(factor):
    # CPU per wall second during the doctor unlike the plain steps': other work came or went.
    steps = DOCTOR.seconds / DOCTOR.step_seconds
    shifted = replace(DOCTOR, cpu_seconds=steps * factor * DOCTOR.step_cpu_seconds)
    time_row, _ = doctor_rows("GPT-2 17M", TRAIN, shifted)
    assert time_row.ok is None and "CPU per wall second" in time_row.figure


@pytest.mark.parametrize("factor", [1 / (NOISY * 1.01), NOISY * 1.01])
def test_a_time_row_is_not_judged_when_the_two_processes_saw_different_loads(factor):
    # The plain step around the doctor unlike the training-only process's: a load came or went.
    time_row, memory_row = doctor_rows("GPT-2 17M", replace(TRAIN, seconds=DOCTOR.step_seconds
                                                            * factor), DOCTOR)
    assert time_row.ok is None and "training-only process's" in time_row.figure
    assert memory_row.ok is not None


def test_a_doctor_run_too_noisy_to_judge_is_taken_again():
    noisy = replace(DOCTOR, step_high=DOCTOR.step_low * NOISY * 2)
    taken = iter([noisy, DOCTOR])
    rows = judged_rows("GPT-2 17M", TRAIN, lambda: next(taken), attempts=2)
    assert rows[0].ok is not None and "attempt 2 of 2" in rows[0].figure
    assert rows[0].ratio == doctor_rows("GPT-2 17M", TRAIN, DOCTOR)[0].ratio
    once = iter([DOCTOR, noisy])
    assert "attempt" not in judged_rows("GPT-2 17M", TRAIN, lambda: next(once))[0].figure
    always = iter([noisy, noisy])
    assert judged_rows("GPT-2 17M", TRAIN, lambda: next(always), attempts=2)[0].ok is None


def test_report_fields_read_as_one_line_or_nothing():
    report = SimpleNamespace(left_out=("16-true check", "islands"), budget="15 steps")
    assert _said(report, "left_out") == "16-true check; islands"
    assert _said(report, "budget") == "15 steps"
    assert _said(SimpleNamespace(), "left_out") == ""  # a doctor without a budget yet
    long = ("timing bf16-mixed (did not fit the budget)", "16-true: its step (about 3.7 plain steps)")
    assert _short(long) == "timing bf16-mixed, 16-true" and _short(None) == ""


def test_rows_refuse_measurements_of_different_set_ups():
    with pytest.raises(ValueError, match="different set-ups"):
        doctor_rows("GPT-2 17M", TRAIN, replace(DOCTOR, threads=2))


@pytest.mark.parametrize("args", [("profile", "tiny", 1), ("train", "gpt2-1B", 1),
                                  ("train", "tiny", 0)])
def test_command_names_what_is_allowed(args):
    with pytest.raises(ValueError, match="allowed|is not one of"):
        command(*args)


@pytest.mark.parametrize("kind, threads", [("train", 2), ("doctor", 1)])
def test_child_reports_its_threads_and_the_peak_the_kernel_saw(kind, threads):
    got, kernel_mib = _run_child(kind, threads)
    assert (got.kind, got.model, got.threads) == (kind, "tiny", threads)
    # Read at the end of the run, the child's own peak is the whole process's peak.
    assert got.peak_mib == pytest.approx(kernel_mib, rel=0.02)
    assert got.seconds > 0 and (got.headline != "") is (kind == "doctor")
    assert (got.step_seconds > 0) is (kind == "doctor")
    assert got.step_low <= got.step_seconds <= got.step_high
    assert (got.import_seconds > 0) is (kind == "doctor")


def test_a_subset_of_the_set_ups_by_model_and_cpu_class():
    from benchmarks.bench_doctor import AVX2, CASES, chosen

    every, demo = chosen(None)
    assert demo and len(every) == 2 * len(CASES) and chosen("  ") == (every, True)
    some, demo = chosen("convnext:host, gpt2-5M:avx2,clip")
    assert not demo
    assert [(m, env is AVX2) for m, _, _, env in some] == [
        ("convnext", False), ("clip", False), ("gpt2-5M", True), ("clip", True)]
    assert chosen("demo-gpt") == ([], True)
    with pytest.raises(ValueError, match="resnet:avx2 not allowed; allowed: .*convnext"):
        chosen("convnext,resnet:avx2")
