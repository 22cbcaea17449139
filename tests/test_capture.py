"""capture: summaries of weights, activations and gradients against torch's own tensors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

import ampnb
from ampnb import putback_state
from ampnb.instruments import summaries, tensor_capture
from ampnb.instruments.coverage_stats import exponent_histogram
from ampnb.instruments.trace import is_internal
from ampnb.models.mlp import MLP


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return MLP(width=8, depth=2), torch.randn(16, 2, generator=g)


def _same(stats, t: torch.Tensor, fmt: str = "fp16") -> None:
    """A record agrees with coverage / histogram computed directly on the tensor."""
    ref = ampnb.coverage(t, fmt)
    assert stats.coverage(fmt) == ref
    assert stats.amax == t.detach().abs().max().item()
    assert stats.histogram == tuple(exponent_histogram(t).tolist())
    assert stats.shape == tuple(t.shape) and stats.count == t.numel()


def _hooks_gone(model: nn.Module) -> bool:
    return all(not m._forward_hooks for m in model.modules()) and all(
        not getattr(p, "_post_accumulate_grad_hooks", None) for p in model.parameters())


def test_weights_activations_and_gradients_match_the_tensors():
    model, x = _mlp()
    with ampnb.capture(model) as cap:
        model(x).pow(2).mean().backward()
    for name, p in model.named_parameters():
        _same(cap.get(name, "weight"), p)
        _same(cap.get(name, "gradient"), p.grad, "bf16")
    h = model.body(x)
    _same(cap.get("body", "activation"), h)
    _same(cap.get("head", "activation"), model.head(h))
    _same(cap.get("body.1", "activation"), model.body[1](model.body[0](x)), "fp8_e4m3")
    assert cap.get("(output)", "activation").amax == model(x).abs().max().item()
    assert _hooks_gone(model)


def test_activation_gradients_match_autograd():
    model, x = _mlp()
    with ampnb.capture(model, kinds=["activation_gradient"], modules="body") as cap:
        model(x).pow(2).mean().backward()
    h = model.body(x)
    (g,) = torch.autograd.grad(model.head(h).pow(2).mean(), h)
    _same(cap.get("body", "activation_gradient"), g)
    assert [s.name for s in cap.records] == ["body"]


def test_select_by_module_pattern_and_kind():
    model, x = _mlp()
    with ampnb.capture(model, kinds=("activation",), modules=["body.0", "head"]) as cap:
        model(x)
    assert {(s.name, s.kind) for s in cap.records} == {("body.0", "activation"),
                                                         ("head", "activation")}
    assert [s.name for s in cap.select("activation", "b*")] == ["body.0"]
    assert cap.select("weight") == []


def test_autocast_activations_are_bf16_and_keep_returns_the_tensor():
    model, x = _mlp()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model.head(model.body(x))
    with ampnb.capture(model, kinds=["activation"], keep=True) as cap, \
            torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)
    s = cap.get("head", "activation")
    assert s.dtype == str(expected.dtype)[6:] == "bfloat16"
    assert torch.equal(s.tensor, expected)
    with ampnb.capture(model, kinds=["weight"]) as plain:
        pass
    assert plain.records[0].tensor is None


def test_repeated_calls_count_and_keep_the_last():
    model, x = _mlp()
    with ampnb.capture(model, kinds=["activation"], modules="head") as cap:
        model(x)
        last = model(2 * x)
    s = cap.get("head", "activation")
    assert s.calls == 2 and s.amax == last.abs().max().item()


def test_hooks_and_state_gone_after_an_exception():
    model, x = _mlp()
    before = putback_state.torch_state()
    with pytest.raises(RuntimeError):
        with ampnb.capture(model, kinds=KINDS):
            model(torch.randn(3, 5))  # wrong width: raises inside the first Linear
    assert _hooks_gone(model) and putback_state.torch_state() == before
    with ampnb.capture(model) as cap:
        pass
    model(x)  # after exit nothing more is recorded
    assert cap.select("activation") == []


KINDS = ("weight", "activation", "gradient", "activation_gradient")


class _Odd(nn.Module):
    """Outputs a tuple with an int tensor, an empty tensor and a dict."""

    def forward(self, x: torch.Tensor):
        return x.argmax(1), x[:0], {"y": x * 2}


def test_odd_outputs_and_a_model_without_parameters():
    x = torch.randn(4, 3)
    with ampnb.capture(_Odd(), kinds=KINDS) as cap:
        _Odd.__call__(cap.model, x)
    names = [s.name for s in cap.records]
    assert names == ["(output)[1]", "(output)[2]['y']"]  # the int tensor is skipped
    empty = cap.get("(output)[1]", "activation")
    assert empty.count == 0 and math.isnan(empty.amax) and empty.coverages == ()
    assert cap.get("(output)[2]['y']", "activation").amax == (x * 2).abs().max().item()
    assert "scalar" not in repr(cap) and "-" in repr(cap)


def test_capture_ops_stay_out_of_a_trace():
    model, x = _mlp()
    with ampnb.trace_ops() as plain:
        model(x)
    with ampnb.capture(model), ampnb.trace_ops() as t:
        model(x)
    assert t.grouped == plain.grouped


def test_table_and_html():
    model, x = _mlp()
    with ampnb.capture(model, formats=["bf16"]) as cap:
        model(x)
    text = repr(cap)
    assert "bf16 overflow" in text and "body.0.weight" in text
    assert "<table" in cap._repr_html_()
    with pytest.raises(ValueError, match="format 'fp16' was not captured; captured: bf16"):
        cap.records[0].coverage("fp16")


def test_bad_input_is_one_line_value_error():
    model, _ = _mlp()
    with pytest.raises(ValueError, match="capture needs an nn.Module, got Tensor"):
        ampnb.capture(torch.ones(1))
    with pytest.raises(ValueError, match="unknown tensor kind 'bias'; allowed: weight"):
        ampnb.capture(model, kinds=["bias"])
    with pytest.raises(ValueError, match="fp12"):
        ampnb.capture(model, formats=["fp12"])
    with pytest.raises(ValueError, match="at least one format"):
        ampnb.capture(model, formats=[])
    with ampnb.capture(model, kinds=["weight"]) as cap:
        pass
    with pytest.raises(ValueError, match="no gradient named 'head.weight' was captured"):
        cap.get("head.weight", "gradient")
    with pytest.raises(ValueError, match="floating-point tensor, got torch.int64"):
        ampnb.instruments.summarize(torch.arange(3))
    assert _hooks_gone(model)


def test_in_place_ops_after_the_hook_do_not_change_what_was_seen():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(inplace=True))
    x = torch.randn(16, 3)
    with ampnb.capture(model, kinds=["activation"], modules="0") as cap:
        model(x)
    pre_relu = model[0](x)  # the Linear's output before ReLU overwrote it in place
    assert (pre_relu < 0).any()
    _same(cap.get("0", "activation"), pre_relu)


def test_weights_are_those_at_entry_even_after_an_optimizer_step():
    """Summaries are computed at exit, from copies taken on entry: a step in between cannot leak in."""
    model, x = _mlp()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=10.0)
    with ampnb.capture(model, kinds=["weight"]) as cap:
        model(x).pow(2).mean().backward()
        opt.step()
    for name, p in model.named_parameters():
        assert not torch.equal(p, before[name])  # the step really changed it in place
        _same(cap.get(name, "weight"), before[name])


def test_an_interrupt_at_any_line_leaves_no_hook_on_the_model():
    from test_trace import _interrupt_at

    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), torch.randn(3, 4)
    files = tuple(str(Path(m.__file__)) for m in (tensor_capture, summaries))

    def cell():
        with ampnb.capture(model, kinds=("weight", "activation", "gradient",
                                         "activation_gradient")) as cap:
            model(x).sum().backward()
        assert cap.records

    def hooks() -> int:
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) \
            + sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())

    before = putback_state.torch_state()
    total = _interrupt_at(0, cell, files)
    assert total > 30 and hooks() == 0
    for k in range(1, total + 1):
        _interrupt_at(k, cell, files)
        assert hooks() == 0, f"a hook was left on the model after an interrupt at line {k}"
        assert putback_state.torch_state() == before and not is_internal(), f"line {k}"
