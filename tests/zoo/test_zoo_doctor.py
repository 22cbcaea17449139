"""Every zoo model through the doctor (cheap: 32-true and bf16-mixed, one timed step)."""

from __future__ import annotations

import copy
import math

import torch
from zoo_models import Case

import ampnb
from ampnb._state import snapshot


def test_doctor_runs_on_zoo_model(case: Case) -> None:
    before = copy.deepcopy(case.model.state_dict())
    state, training = snapshot(), case.model.training
    report = ampnb.doctor(case.model, case.batch, case.loss_fn, modes=("32-true", "bf16-mixed"),
                          repeat=1, profile=False)
    after = case.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert snapshot() == state and case.model.training == training
    ref = report.modes[0]
    if len(report.modes) == 1:  # e.g. oneDNN's bf16 LSTM needs bf16 units this CPU may lack
        assert any(s.startswith("bf16-mixed: could not run") for s in report.skipped)
        return
    bf16 = report.mode("bf16-mixed")
    assert ref.loss_error == 0 and ref.grad_error == 0 and ref.finite
    assert math.isfinite(bf16.loss) and 0 < bf16.grad_error < math.inf
    assert bf16.param_bytes == ref.param_bytes and bf16.optimizer_bytes == ref.optimizer_bytes
    leaves = [lr for lr in report.layers if lr.leaf]
    assert leaves and any("bf16-mixed" in lr.local for lr in leaves)
    assert report.recommended.mode in ("32-true", "bf16-mixed")
    assert report.recommended.code and repr(report).startswith("On cpu: use ")
