"""find_nonfinite: blames planted overflows (tiny fp16 tensors on CPU), checked against fp32."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from _garbage import Garbage as _Garbage
from torch import nn

import ampnb
from ampnb import putback_state

FP16_MAX = torch.finfo(torch.float16).max


def _planted() -> tuple[nn.Module, torch.Tensor]:
    """Layer "2" overflows fp16 in the forward pass; the others are harmless."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Linear(4, 2))
    with torch.no_grad():
        m[0].weight.fill_(1.0)
        m[0].bias.zero_()
        m[2].weight.fill_(1000.0)
    return m, torch.full((3, 4), 100.0)


def _step(m: nn.Module, x: torch.Tensor, dtype: torch.dtype = torch.float16):
    def step() -> torch.Tensor:
        with torch.autocast("cpu", dtype=dtype):
            y = m(x)
        y.float().sum().backward()
        return y
    return step


def test_blames_the_planted_layer_in_the_forward_phase():
    m, x = _planted()
    before = putback_state.torch_state()
    r = ampnb.find_nonfinite(_step(m, x))
    assert putback_state.torch_state() == before
    exact = m[2](m[1](m[0](x))).detach().abs().max().item()  # the same layer in fp32
    assert exact > FP16_MAX  # the reference confirms the plant overflows fp16
    assert r and (r.op, r.module, r.phase) == ("addmm", "2", "forward")
    assert r.output_dtype == "float16" and r.format == "fp16" and r.format_max == FP16_MAX
    assert r.inputs_finite and all(i.finite for i in r.inputs)
    assert math.isclose(r.exact_amax, exact, rel_tol=1e-3)
    assert max(i.amax for i in r.inputs) < FP16_MAX  # finite inputs, overflowing product
    assert r.n_inf == r.count == 3 * 4 and r.value is not None
    assert "addmm in 2 (forward)" in r.message and "fp16's max 65504" in r.message


def test_finite_run_is_falsy_and_returns_the_value():
    m, x = _planted()
    r = ampnb.find_nonfinite(_step(m, x, torch.bfloat16))  # bf16 has fp32's range
    assert not r and r.ops_checked > 10
    assert r.value.dtype == torch.bfloat16 and "no inf/NaN" in repr(r)


def test_attention_mask_of_minus_inf_is_not_blamed():
    torch.manual_seed(0)
    q = torch.randn(2, 4, 4)
    causal = torch.ones(4, 4).triu(1).bool()

    def attend():
        scores = (q @ q.transpose(1, 2)).masked_fill(causal, -math.inf)
        return scores.softmax(-1) @ q

    r = ampnb.find_nonfinite(attend)
    assert not r and r.deliberate == 1 and torch.isfinite(r.value).all()
    assert "masked_fill" in r.message


def test_backward_overflow_is_blamed_on_the_module_in_backward():
    lin = nn.Linear(4, 1, bias=False).half()
    with torch.no_grad():
        lin.weight.fill_(0.01)
    x = torch.full((64, 4), 2.0, dtype=torch.float16)
    r = ampnb.find_nonfinite(lambda: (lin(x) * 1000).sum().backward())
    ref = nn.Linear(4, 1, bias=False)
    ref.weight.data.fill_(0.01)
    (ref(x.float()) * 1000).sum().backward()
    assert ref.weight.grad.abs().max() > FP16_MAX  # fp32 gradient beyond fp16
    assert (r.op, r.module, r.phase) == ("mm", "Linear", "backward")
    assert math.isclose(r.exact_amax, ref.weight.grad.abs().max().item(), rel_tol=1e-3)


def test_in_place_op_is_blamed_by_its_inputs_before_it_ran():
    t = torch.full((4,), 300.0, dtype=torch.float16)
    r = ampnb.find_nonfinite(lambda: t.mul_(1000.0))
    assert r.op == "mul_" and r.inputs_finite and r.n_inf == 4
    assert math.isnan(r.exact_amax)  # the inputs were overwritten: no recomputation


def test_non_finite_data_is_reported_as_coming_from_outside():
    m, x = _planted()
    x[0, 0] = math.nan
    r = ampnb.find_nonfinite(lambda: m(x))
    assert not r  # nothing inside made it: the report is falsy, and says where it came in
    assert not r.inputs_finite and (r.op, r.module) == ("addmm", "0") and r.n_nan > 0
    assert "from outside" in r.message and "addmm in 0 (forward)" in r.message


def test_everything_detached_after_an_error_and_the_error_names_the_finding():
    m, x = _planted()
    before = putback_state.torch_state()

    def step():
        _step(m, x)()
        raise FloatingPointError("loss is inf")

    with pytest.raises(FloatingPointError) as info:
        ampnb.find_nonfinite(step)
    assert "addmm in 2 (forward)" in "".join(getattr(info.value, "__notes__", []))
    assert putback_state.torch_state() == before
    assert all(not mod._forward_hooks for mod in m.modules())


def test_table_shows_inputs_against_the_format():
    m, x = _planted()
    r = ampnb.find_nonfinite(_step(m, x))
    text = repr(r)
    assert "vs fp16 max" in text and f"{r.exact_amax / FP16_MAX:.3g}x max" in text
    assert "<table" in r._repr_html_()


def test_bad_input_is_one_line_value_error():
    with pytest.raises(ValueError, match="needs a function to run.*got Tensor"):
        ampnb.find_nonfinite(torch.ones(2))


def test_out_argument_holding_garbage_is_not_taken_for_an_input():
    a = torch.full((4,), 60000.0, dtype=torch.float16)
    buf = torch.full((4,), math.nan, dtype=torch.float16)  # what torch.empty may hold
    r = ampnb.find_nonfinite(lambda: torch.add(a, a, out=buf))
    assert r.op == "add" and r.inputs_finite and r.n_inf == 4
    assert len(r.inputs) == 2 and r.exact_amax == (a.double() + a.double()).max().item()


def test_dropout_allocation_holding_minus_inf_is_not_blamed():
    x = torch.randn(64, 128)
    with _Garbage():
        r = ampnb.find_nonfinite(lambda: F.dropout(x, 0.1, training=True))
    assert not r and r.op == "" and r.ops_checked >= 3
    assert torch.isfinite(r.value).all()  # the reference: dropout's result really is finite


def test_issue_repro_softmax_of_a_causal_mask_then_dropout_is_falsy():
    def f(x):
        mask = torch.full((64, 128), float("-inf")).triu(1)
        return F.dropout(torch.softmax(x + mask, -1), 0.1, training=True)

    x = torch.randn(64, 128)
    poison = torch.full((64, 128), -math.inf)  # leftover -inf where dropout will allocate
    del poison
    r = ampnb.find_nonfinite(f, x)
    assert not r and r.deliberate == 1 and torch.isfinite(r.value).all()
    with _Garbage():
        r = ampnb.find_nonfinite(f, x)
    assert not r and r.op == "" and "no inf/NaN made from finite values" in r.message


def test_planted_overflow_after_dropout_is_named_not_the_allocation():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Dropout(0.1), nn.Linear(4, 4)).train()
    with torch.no_grad():
        m[1].weight.fill_(1000.0)
    x = torch.full((3, 4), 100.0)
    with _Garbage():
        r = ampnb.find_nonfinite(_step(m, x))
    assert r and (r.op, r.module, r.phase) == ("addmm", "1", "forward") and r.inputs_finite


def test_copy_into_an_uninitialised_buffer_reads_only_its_source():
    src = torch.full((4,), 1e5)  # beyond fp16's max: copying it into fp16 overflows
    with _Garbage():
        r = ampnb.find_nonfinite(lambda: torch.empty(4, dtype=torch.float16).copy_(src))
    assert torch.isinf(src.half()).all()  # torch's own cast: the reference
    assert r and r.op == "copy_" and r.inputs_finite and len(r.inputs) == 1
    assert r.inputs[0].amax == 1e5 and r.n_inf == 4
