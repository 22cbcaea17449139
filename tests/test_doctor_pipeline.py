"""The doctor answers first (#36): the same random draws in every mode, costs measured here,
budgets held, islands never lost over the cap, failures and devices named."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from doctor_models import (
    DrawsByDtype,
    DtypeDrawn,
    Fp32Embedding,
    ManyLeaves,
    NumpyMasked,
    Plain,
    SlowInFp16,
    SlowStep,
    data,
)
from torch import nn

import ampnb
import ampnb.diagnosis.pipeline as pipeline
from ampnb.diagnosis import budget
from ampnb.diagnosis.candidates import candidates
from ampnb.diagnosis.evidence import acceptable

CE = nn.functional.cross_entropy
QUIET = dict(profile=False, progress=lambda _: None)


def test_draws_that_depend_on_the_dtype_are_not_read_as_precision_error():
    # the planted module really draws different masks in fp32 and bf16 from one seed
    x = torch.randn(8, 64)
    masks = []
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        masks.append(DtypeDrawn()(x.to(dtype)) != 0)
    assert not torch.equal(*masks)
    model = DrawsByDtype()
    r = ampnb.doctor(model, data(), CE, modes=("32-true", "bf16-mixed"), **QUIET)
    row = r.mode("bf16-mixed")
    # with its masks drawn per dtype the gradient error read 0.5-1; the module is kept from
    # drawing, so what is left is bf16's own error
    assert acceptable(row, r.tolerance.loss, r.tolerance.grad), row.grad_error
    assert any("drop" in n and "not drawing" in n for n in r.range_notes)
    assert model.drop.training  # the user's model is untouched: only the doctor's copies


def test_numpy_masks_are_drawn_alike_and_the_users_numpy_state_is_kept():
    np.random.seed(123)
    before = np.random.get_state()
    r = ampnb.doctor(NumpyMasked(), data(), CE, modes=("32-true", "bf16-mixed", "16-mixed"),
                     budget=math.inf, **QUIET)
    after = np.random.get_state()
    assert before[0] == after[0] and np.array_equal(before[1], after[1]) and before[2] == after[2]
    # the same masks in every mode: bf16-mixed holds, and 16-mixed's island is exactly the layer
    # that overflows, no bystander
    assert acceptable(r.mode("bf16-mixed"), r.tolerance.loss, r.tolerance.grad)
    fixed = [m for m in r.modes if m.name == "16-mixed" and m.keep_fp32]
    assert fixed and fixed[0].keep_fp32 == ("up",)
    assert any("own forward draws" in n for n in r.range_notes)


def _native(modes, device):
    """Candidates as on a CPU with fp16 units (AMX): every mode counted native."""
    found, skipped = candidates(modes, device)
    return [c if c.name == "32-true" else c.__class__(c.name, c.mode, c.device, c.tf32, True, "native",
                                                      c.fp16_kernels) for c in found], skipped


def test_a_gradscaler_back_off_counts_against_a_tiny_budget(monkeypatch):
    """16-mixed (made native here) whose backward overflows at 2^16: a GradScaler backs off
    ten times (checked with a plain torch.amp loop in test_doctor); each step costs 0.2 s and
    the budget is 5 of them, so the back-off stops and says why."""
    def big_loss(out, t):
        return CE(out, t) * 3e3

    monkeypatch.setattr(pipeline, "candidates", _native)
    monkeypatch.setattr(budget, "MIN_SECONDS", 1.0)  # the floor tests otherwise raise to 60 s
    r = ampnb.doctor(SlowStep(), data(), big_loss, modes=("32-true", "16-mixed"),
                     budget="5 steps", **QUIET)
    row = r.mode("16-mixed")
    assert row.skipped < 10 and not row.finite, (r.budget, r.left_out)
    assert any("another step at half the loss scale" in s for s in r.left_out)


def test_a_slow_fp16_step_is_measured_before_it_runs_and_left_out_when_over_the_budget(
        monkeypatch):
    """On a CPU with native but slow fp16 kernels (fp16 convolutions at 8-50x a plain step)."""
    monkeypatch.setattr(pipeline, "candidates", _native)
    monkeypatch.setattr(budget, "MIN_SECONDS", 1.0)  # the floor tests otherwise raise to 60 s
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a toy model's step on a loaded machine: no OpenMP spin
    try:
        r = ampnb.doctor(SlowInFp16(), data(16), CE, modes=("32-true", "bf16-mixed", "16-mixed"),
                         **QUIET)
    finally:
        torch.set_num_threads(threads)
    said = [s for s in r.left_out if s.startswith("16-mixed: its step")]
    # the probe's forward on its slice (2 of 16 samples: 1 s injected) is stopped where the mode
    # could no longer fit: a price past the whole budget, or past what is left, is said
    assert said and ("more than the whole budget" in said[0] and "measured" in said[0] or
                     "stopped past about" in said[0]), r.left_out
    if "stopped past" in said[0]:  # a price it could not fit in (with one plain step in hand)
        steps, left = map(float, re.findall(r"([\d.]+) plain steps", said[0])[:2])
        assert 1.25 * steps + 1 > left
    assert "16-mixed" not in [m.name for m in r.modes]
    assert r.mode("bf16-mixed").ratio is not None  # the verdict's mixed mode is still timed


def test_islands_over_the_cap_are_grouped_under_their_parents():
    r = ampnb.doctor(ManyLeaves(), data(), CE, modes=("32-true", "16-mixed"), budget=math.inf,
                     **QUIET)
    assert not r.mode("16-mixed").finite
    fixed = [m for m in r.modes if m.name == "16-mixed" and m.keep_fp32]
    assert fixed, r.left_out
    assert set(fixed[0].keep_fp32) == {"blocks.0.dense", "blocks.1.dense"}
    assert fixed[0].finite


@pytest.mark.skipif(torch.cuda.is_available(), reason="simulates CUDA on a CPU machine")
def test_the_doctor_runs_where_the_model_is_and_a_stated_device_must_agree(gpu_machine):
    model = Plain()
    r = ampnb.doctor(model, data(), CE, modes=("32-true", "bf16-mixed"), **QUIET)
    assert r.device == "cpu" and r.verdict.startswith("On cpu (where the model's parameters are)")
    with pytest.raises(ValueError, match=r"device=cuda but the model's parameters are on cpu"):
        ampnb.doctor(model, data(), CE, device="cuda", **QUIET)


def test_a_mode_that_fails_is_named_with_its_error_and_the_others_still_run():
    r = ampnb.doctor(Fp32Embedding(), data(), CE, modes=("32-true", "bf16-mixed", "bf16-true"),
                     **QUIET)
    said = [s for s in r.skipped if s.startswith("bf16-true")]
    assert said and "RuntimeError" in said[0] and "dtype" in said[0]
    assert "not run: " + said[0] in repr(r.table())
    assert r.mode("bf16-mixed").ratio is not None  # the modes that ran are reported
