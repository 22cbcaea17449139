"""FP8 on the zoo: every Linear / Conv1D converts, the rest is named by type (low-bit: test_zoo_lowbit)."""

from __future__ import annotations

import copy
import warnings
from collections import Counter

import pytest
import torch
from torch import nn
from zoo_models import BUILDERS, Case, matmul_layers, others_by_type

from ampnb.batch import as_batch, step_loss
from ampnb.fp8 import Fp8Linear, convert_to_fp8, plan, side_by_side
from ampnb.fp8.convert import ALIGN_IN, ALIGN_OUT
from ampnb.putback_state import torch_state as snapshot


def features(m: nn.Module) -> tuple[int, int]:
    return (m.in_features, m.out_features) if isinstance(m, nn.Linear) else (m.nx, m.nf)


def test_gpt2_every_conv1d_and_the_lm_head_run_in_fp8():
    case = BUILDERS["gpt2"]()
    layers = matmul_layers(case.model)
    kinds = Counter(type(m).__name__ for m in layers.values())
    assert kinds == {"Conv1D": 8, "Linear": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every layer is aligned: nothing to warn about
        model, report = convert_to_fp8(case.model)
    assert set(report.converted) == set(layers) == set(plan(case.model).converted)
    for name, layer in layers.items():
        new = model.get_submodule(name)
        assert isinstance(new, Fp8Linear) and new.transposed == (type(layer).__name__ == "Conv1D")
    assert report.left_out == others_by_type(case.model) == (("LayerNorm", 5), ("Embedding", 2))
    assert "left out (not Linear or Conv1D): 5 LayerNorm, 2 Embedding" in repr(report)
    # Ties survive: the FP8 lm_head still shares the embedding's Parameter.
    assert model.lm_head.weight is model.transformer.wte.weight


def test_gpt2_with_unaligned_widths_blames_each_conv1d_not_only_the_head():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_positions=16, n_embd=36, n_layer=1,
                                       n_head=2))
    layers = matmul_layers(model)
    with pytest.raises(ValueError) as err:
        convert_to_fp8(model)
    msg = str(err.value)
    for name, layer in layers.items():
        n_in, n_out = features(layer)
        assert f"'{name}' ({type(layer).__name__} {n_in}→{n_out}: " in msg
        assert n_in % ALIGN_IN == 0 or f"in_features {n_in} is not a multiple of {ALIGN_IN}" in msg
        assert n_out % ALIGN_OUT == 0 or f"out_features {n_out} is not a multiple of 16" in msg
    assert "Conv1D" in msg and "left out: 3 LayerNorm, 2 Embedding" in msg


def test_fp8_conversion_runs_a_step_and_names_what_was_left_out(case: Case):
    before = snapshot()
    predicted = plan(case.model)
    assert predicted.left_out == others_by_type(case.model)
    assert {c.name for c in predicted.layers} == set(matmul_layers(case.model))
    if not predicted.converted:  # e.g. a 5-class head: the one matmul layer is unaligned
        with pytest.raises(ValueError, match="no layer of this .* can run in FP8") as err:
            convert_to_fp8(case.model)
        assert all(f"'{c.name}'" in str(err.value) for c in predicted.skipped)
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, report = convert_to_fp8(case.model)
    assert report.converted == predicted.converted and report.left_out == predicted.left_out
    assert bool(caught) == bool(report.skipped)
    batch = as_batch(case.batch, case.loss_fn)
    loss = step_loss(batch.call(model), batch, case.loss_fn)
    loss.backward()
    assert torch.isfinite(loss)
    for name in report.converted:
        grad = model.get_submodule(name).weight.grad
        assert grad is not None and torch.isfinite(grad).all()
    assert snapshot() == before


def hand_losses(case: Case, optimizer: bool, steps: int) -> list[float]:
    """32-true training of a copy, written out with plain torch."""
    if optimizer:
        model, opt = copy.deepcopy((case.model, case.optimizer()))
    else:
        model = copy.deepcopy(case.model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(0)
    losses = []
    for _ in range(steps):
        loss = model(**case.batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("optimizer", [False, True])
def test_side_by_side_takes_a_users_model_and_leaves_it_alone(optimizer):
    case = BUILDERS["gpt2"]()
    state = copy.deepcopy(case.model.state_dict())
    opt = case.optimizer() if optimizer else None
    before = snapshot()
    result = side_by_side(case.model, case.batch, optimizer=opt, steps=2,
                          runs=("32-true", "fp8"))
    assert snapshot() == before
    assert list(result.losses["32-true"]) == hand_losses(case, optimizer, 2)
    assert result.losses["fp8"] != result.losses["32-true"]
    assert set(result.report.converted) == set(matmul_layers(case.model))
    assert not any(isinstance(m, Fp8Linear) for m in case.model.modules())
    assert all(torch.equal(v, state[k]) for k, v in case.model.state_dict().items())
    assert opt is None or not opt.state  # the user's optimizer never stepped


def test_side_by_side_rejects_a_bad_model_or_optimizer():
    case = BUILDERS["lstm"]()
    with pytest.raises(ValueError, match="model=3 is not allowed"):
        side_by_side(3, case.batch, case.loss_fn)
    with pytest.raises(ValueError, match="optimizer='adam' is not allowed"):
        side_by_side(case.model, case.batch, case.loss_fn, optimizer="adam", steps=1)
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="not this model's parameters"):
        side_by_side(case.model, case.batch, case.loss_fn, optimizer=other, steps=1)
    with pytest.raises(ValueError, match="a demo brings its own"):
        side_by_side("gpt", case.batch)
