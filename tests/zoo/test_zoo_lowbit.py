"""bitsandbytes modes and 8-bit Adam on the zoo: every Linear / Conv1D replaced, the rest named by type."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch import nn
from zoo_models import BUILDERS, Case, matmul_layers, others_by_type

from ampnb.batch import as_batch, step_loss
from ampnb.lowbit import Adam8bit, Linear4bit, get_lowbit, param_groups, quantize_model, roundtrip
from ampnb.putback_state import torch_state as snapshot


def model_inputs(case: Case):
    """The model's inputs alone: a pair with a loss_fn is (inputs, targets)."""
    return case.batch[0] if case.loss_fn is not None else case.batch


def test_gpt2_nf4_replaces_every_conv1d_and_is_not_free():
    case = BUILDERS["gpt2"]()
    layers = matmul_layers(case.model)
    q, report = quantize_model(case.model, "nf4")
    assert report.quantized == (("Linear", 1), ("Conv1D", 8))
    assert report.left_out == (("LayerNorm", 5), ("Embedding", 2))
    nf4 = get_lowbit("nf4")
    expected_bits = 0.0
    for name, layer in layers.items():
        conv = not isinstance(layer, nn.Linear)
        w = layer.weight.detach().t() if conv else layer.weight.detach()
        expected_bits += nf4.bits_per_param(w.shape) * w.numel()
        new = q.get_submodule(name)
        assert isinstance(new, Linear4bit) and new.transposed == conv
        # The (out, in) layout bitsandbytes uses, from the fp16 weight, computed in bf16.
        rounded = roundtrip(w.half(), "nf4").to(torch.bfloat16)
        assert torch.equal(new.weight.t() if conv else new.weight, rounded)
    assert report.quantized_bytes == expected_bits / 8
    conv = [e for e in report.layers if e.kind == "Conv1D"]
    assert len(conv) == 8 and all(e.max_abs_error > 0 and e.weight_sqnr_db < 40 for e in conv)


def test_nf4_counts_what_it_quantized_and_left_out_by_type(case: Case):
    layers = matmul_layers(case.model)
    if not layers:
        pytest.skip("no matmul layer")
    state = copy.deepcopy(case.model.state_dict())
    _, report = quantize_model(case.model, "nf4")
    assert dict(report.quantized) == dict(Counter(type(m).__name__ for m in layers.values()))
    assert report.left_out == others_by_type(case.model)
    assert all(torch.equal(v, state[k]) for k, v in case.model.state_dict().items())


def test_nf4_output_error_is_measured_in_eval_mode_and_leaves_the_model(case: Case):
    if not matmul_layers(case.model):
        pytest.skip("no matmul layer")
    state = copy.deepcopy(case.model.state_dict())
    q, report = quantize_model(case.model, "nf4", inputs=model_inputs(case))
    # The model is left as it was: train mode, and no BatchNorm statistics moved.
    assert all(m.training for m in case.model.modules())
    assert all(torch.equal(v, state[k]) for k, v in case.model.state_dict().items())
    # Reference: each layer's output captured by hand on eval-mode copies (no dropout).
    outs = []
    for m in (copy.deepcopy(case.model).eval(), copy.deepcopy(q).eval()):
        got = {}
        for e in report.layers:
            m.get_submodule(e.name).register_forward_hook(
                lambda _m, _i, o, n=e.name, d=got: d.__setitem__(n, o))
        with torch.no_grad():
            as_batch(model_inputs(case)).call(m)
        outs.append(got)
    for e in report.layers:
        ref = outs[0][e.name].double()
        noise = ref - outs[1][e.name].double()
        expected = (20 * torch.log10(ref.norm() / noise.norm())).item()
        assert e.output_sqnr_db == pytest.approx(expected, rel=1e-9)


def test_int8_training_and_adam8bit_run_a_step(case: Case):
    if not matmul_layers(case.model):
        pytest.skip("no matmul layer")
    before = snapshot()
    model, _ = quantize_model(case.model, "int8-training")
    opt = Adam8bit(param_groups(model, (nn.Embedding,)), lr=1e-3, min_8bit_size=1024)
    batch = as_batch(case.batch, case.loss_fn)
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = step_loss(batch.call(model), batch, case.loss_fn)
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, w0[n])]
    assert any(n.endswith("weight16") for n in moved)  # the fp16 weights train
    eight = {id(p) for g in opt.param_groups for p in g["params"] if "exp_avg_codes" in opt.state[p]}
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    assert eight and not eight & embeddings
    assert snapshot() == before
