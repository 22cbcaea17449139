"""find_nonfinite blames causes, not bystanders: inf/NaN made on purpose and masked away
(T5's log(0) under torch.where, softmax over a -inf mask) is listed as discarded, never blamed,
and a real overflow after it is still named."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import ampnb

FP16_MAX = torch.finfo(torch.float16).max


class LogBuckets(nn.Module):
    """T5's relative-position buckets in miniature: log(0) = -inf, discarded by torch.where."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(4.0)  # holds a 0: log gives -inf there
        bias = torch.where(pos > 0, torch.log(pos), 0.0)
        return self.proj(x) + bias


def _reference_log_is_discarded() -> None:
    pos = torch.arange(4.0)
    assert torch.isinf(torch.log(pos)).any()  # the op really makes -inf
    assert torch.isfinite(torch.where(pos > 0, torch.log(pos), 0.0)).all()  # and it is masked


def test_masked_log_in_fp32_is_discarded_not_blamed():
    _reference_log_is_discarded()
    torch.manual_seed(0)
    m = LogBuckets()
    x = torch.randn(3, 4)

    def step():
        loss = m(x).sum()
        loss.backward()
        return loss

    r = ampnb.find_nonfinite(step)
    assert not r and r.op == ""
    assert torch.isfinite(r.value) and all(torch.isfinite(p.grad).all() for p in m.parameters())
    assert [(d.op, d.module) for d in r.discarded] == [("log", "LogBuckets")]
    assert "discarded" in r.message and "float32 log in LogBuckets" in r.message


def test_planted_fp32_overflow_after_a_masked_log_is_named():
    torch.manual_seed(0)
    m = LogBuckets()
    x = torch.randn(3, 4)

    def step():
        loss = (m(x) * 1e39).sum()  # 1e39 is beyond fp32's max: the product is inf
        loss.backward()

    assert torch.isinf(m(x).detach() * 1e39).any()  # the reference: the plant overflows fp32
    r = ampnb.find_nonfinite(step)
    assert r and r.op == "mul" and r.inputs_finite and r.output_dtype == "float32"
    assert [d.op for d in r.discarded] == ["log"]
    assert "mul in" in r.message and "discarded" in r.message


def test_planted_fp16_overflow_under_autocast_after_a_masked_log_is_named():
    torch.manual_seed(0)
    m = nn.Sequential(LogBuckets(), nn.Linear(4, 4))
    with torch.no_grad():
        m[1].weight.fill_(1000.0)
    x = torch.full((3, 4), 100.0)
    with torch.no_grad():
        exact = m(x).abs().max().item()  # the same step in fp32: the reference
    assert exact > FP16_MAX

    def step():
        with torch.autocast("cpu", dtype=torch.float16):
            y = m(x)
        y.float().sum().backward()

    r = ampnb.find_nonfinite(step)
    assert r and (r.op, r.module, r.phase) == ("addmm", "1", "forward") and r.inputs_finite
    assert math.isclose(r.exact_amax, exact, rel_tol=1e-2)
    assert [d.op for d in r.discarded] == ["log"]


def test_minus_inf_attention_scores_through_softmax_are_not_blamed():
    torch.manual_seed(0)
    q = torch.randn(2, 4, 4, requires_grad=True)
    causal = torch.ones(4, 4).triu(1).bool()

    def attend():
        scores = q @ q.transpose(1, 2) + torch.zeros(4, 4).masked_fill(causal, -math.inf)
        out = scores.softmax(-1) @ q
        out.sum().backward()
        return out

    r = ampnb.find_nonfinite(attend)
    assert not r and r.op == "" and r.deliberate == 1
    assert torch.isfinite(r.value).all() and torch.isfinite(q.grad).all()


def test_minus_inf_from_finite_values_through_softmax_is_discarded():
    torch.manual_seed(0)
    s = torch.randn(2, 4)
    keep = torch.tensor([1.0, 1.0, 0.0, 1.0])

    def attend():  # the mask's -inf made by an op (log of a 0/1 mask), not a constant
        return torch.softmax(s + torch.log(keep), -1)

    r = ampnb.find_nonfinite(attend)
    assert not r and torch.isfinite(r.value).all()
    assert [d.op for d in r.discarded] == ["log"]


def test_inf_that_reaches_the_returned_value_is_blamed():
    a = torch.full((4,), 60000.0, dtype=torch.float16)
    r = ampnb.find_nonfinite(lambda: a + a)
    assert r and r.op == "add" and not r.discarded


def test_checking_for_inf_does_not_discard_it():
    a = torch.full((4,), 60000.0, dtype=torch.float16)

    def step():
        y = a + a
        assert bool(torch.isinf(y).any())  # inspecting is no masking
        return None

    r = ampnb.find_nonfinite(step)
    assert r and r.op == "add"


def test_tiny_t5_in_fp32_is_falsy_with_its_log_discarded():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=1,
                                num_decoder_layers=1, num_heads=2, decoder_start_token_id=0)
    model = transformers.T5ForConditionalGeneration(cfg)
    ids = torch.randint(1, 32, (2, 6))

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss

    r = ampnb.find_nonfinite(step)
    assert not r and torch.isfinite(r.value)
    assert r.discarded and all(d.op == "log" for d in r.discarded)
    assert any("SelfAttention" in d.module for d in r.discarded)
