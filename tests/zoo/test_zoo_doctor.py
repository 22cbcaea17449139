"""Every zoo model through the doctor (cheap: 32-true and bf16-mixed, one timed step); OPT in
16-true, whose AdamW step turns its weights into NaN."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from zoo_models import Case

import ampnb
from ampnb.formats import get_format
from ampnb.putback_state import torch_state as snapshot


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
        assert any(s.startswith("bf16-mixed: its step failed here") for s in report.skipped)
        return
    bf16 = report.mode("bf16-mixed")
    assert ref.loss_error == 0 and ref.grad_error == 0 and ref.finite
    assert math.isfinite(bf16.loss) and 0 < bf16.grad_error < math.inf
    assert bf16.param_bytes == ref.param_bytes and bf16.optimizer_bytes == ref.optimizer_bytes
    leaves = [lr for lr in report.layers if lr.leaf]
    # end-to-end error per module for the candidate, streamed against the reference's outputs
    assert leaves and any(0 <= lr.end_to_end["bf16-mixed"].rel < math.inf for lr in leaves)
    assert all(lr.end_to_end["32-true"].rel == 0 for lr in report.layers)
    assert report.recommended.mode in ("32-true", "bf16-mixed")
    assert report.recommended.code and repr(report).startswith(
        "On cpu (where the model's parameters are): use ")


def test_opt_16_true_with_adamw_is_not_finite_and_names_eps() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=1, ffn_dim=64, num_attention_heads=2,
        max_position_embeddings=32, word_embed_proj_dim=32))
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    report = ampnb.doctor(model, batch, optimizer=opt, modes=("32-true", "16-true"), repeat=1,
                          profile=False)
    row = report.mode("16-true")
    assert math.isfinite(row.loss) and not row.finite
    assert f"AdamW eps={opt.defaults['eps']!r} is 0 in {get_format(torch.float16).name}" \
        in row.nonfinite
    assert report.recommended.mode != "16-true"
    assert report.low_precision is None or report.low_precision.mode != "16-true"
