"""The instruments on every zoo model: trace, hunt and capture, against plain torch references."""

from __future__ import annotations

import contextlib

import pytest
import torch
from _garbage import Garbage as _Garbage
from zoo_models import BUILDERS, Case

import ampnb
from ampnb import putback_state
from ampnb.batch import as_batch, step_loss

FP16_MAX = torch.finfo(torch.float16).max
MATMULS = {"mm", "addmm", "bmm", "baddbmm", "convolution", "_convolution", "linear", "matmul",
           "mkldnn_rnn_layer"}


def _step(case: Case, dtype: torch.dtype | None = None):
    """One forward + backward of the case, under CPU autocast when dtype is given."""
    batch = as_batch(case.batch, case.loss_fn)

    def step() -> torch.Tensor:
        region = torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()
        with region:
            out = batch.call(case.model)
            loss = step_loss(out, batch, case.loss_fn)
        loss.float().backward()
        return out

    return step


def _logits(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


def test_trace_agrees_with_autocast(case: Case):
    before = putback_state.torch_state()
    with ampnb.trace_ops() as fp32:
        _step(case)()
    c = fp32.counts
    assert c["lowered"] == c["cast"] == 0 and c["kept"] > 0  # 32-true: nothing lowered
    assert not any(r.cast for r in fp32.rows)
    case.model.zero_grad()
    batch = as_batch(case.batch, case.loss_fn)
    try:  # the reference: plain torch under the same autocast
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            expected = _logits(batch.call(case.model)).dtype
    except RuntimeError as e:  # oneDNN's bf16 LSTM needs AVX512-BF16: then torch's error
        with pytest.raises(RuntimeError, match=str(e).split(".")[0]):
            with ampnb.trace_ops():
                _step(case, torch.bfloat16)()
        assert putback_state.torch_state() == before
        return
    with ampnb.trace_ops() as mixed:
        _step(case, torch.bfloat16)()
    assert expected == torch.bfloat16
    low = [r for r in mixed.select(phase="forward") if r.op in MATMULS
           and r.output_dtype == "bfloat16"]
    assert low and all(r.category == "lowered" for r in low)
    assert mixed.counts["cast"] > 0 and mixed.select(phase="backward")
    assert putback_state.torch_state() == before


def test_healthy_fp32_train_step_is_not_blamed(case: Case):
    assert case.model.training  # dropout on, as transformers builds them
    with _Garbage():
        r = ampnb.find_nonfinite(_step(case))
    assert not r and r.op == "" and r.ops_checked > 50, r.message
    assert torch.isfinite(_logits(r.value)).all()


def test_gpt2_overflow_planted_in_the_last_block_is_named_with_dropout_on():
    case = BUILDERS["gpt2"]()
    fc = case.model.transformer.h[1].mlp.c_fc
    with torch.no_grad():
        fc.weight.mul_(3e5)  # still within fp16 itself, but not its products
    seen = []
    handle = fc.register_forward_hook(lambda m, a, o: seen.append(a[0].detach().float()))
    case.model(**case.batch)  # the reference: the same layer in fp32
    handle.remove()
    exact = (seen[0] @ fc.weight.float() + fc.bias).abs().max().item()
    assert exact > FP16_MAX and torch.isfinite(fc.weight.half()).all() and case.model.training
    with _Garbage():
        r = ampnb.find_nonfinite(_step(case, torch.float16))
    assert r and (r.op, r.module, r.phase) == ("addmm", "transformer.h.1.mlp.c_fc", "forward")
    assert r.inputs_finite and r.output_dtype == "float16" and r.exact_amax > FP16_MAX


def _last_leaf_with_weights(model: torch.nn.Module) -> str:
    return [n for n, m in model.named_modules()
            if n and not any(m.children()) and next(m.parameters(False), None) is not None][-1]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_capture_records_all_kinds_and_matches_coverage_by_hand(case: Case):
    model = case.model
    leaf = _last_leaf_with_weights(model)
    outputs = []
    handle = model.get_submodule(leaf).register_forward_hook(
        lambda m, a, o: outputs.append(o.detach().clone()))
    fmts = ("fp16", "bf16", "fp8_e4m3")
    with ampnb.capture(model, formats=fmts) as cap:
        _step(case)()
    handle.remove()
    kinds = {r.kind for r in cap.records}
    assert {"weight", "activation", "gradient"} <= kinds
    act = cap.get(leaf, "activation")
    params = dict(model.named_parameters())
    weight = next(r for r in cap.select("weight") if r.name in params)
    grad = next(r for r in cap.select("gradient") if r.name in params)
    for record, tensor in ((act, outputs[0]), (weight, params[weight.name].detach()),
                           (grad, params[grad.name].grad)):
        assert record.shape == tuple(tensor.shape)
        by_hand = {f: ampnb.coverage(tensor, f) for f in fmts}
        assert all(record.coverage(f) == by_hand[f] for f in by_hand), record.name
