"""Fp8Stats records what each cast did; side_by_side trains like hand-written loops."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ampnb.formats import quantize
from ampnb.fp8 import DelayedScaling, Fp8Linear, Fp8Stats, convert_to_fp8, side_by_side, sqnr
from ampnb.putback_state import torch_state as snapshot


def layer_and_inputs():
    torch.manual_seed(0)
    layer = Fp8Linear(32, 16, recipe=DelayedScaling(amax_history_len=4))
    # Growing inputs: delayed scales lag behind, so the later steps saturate.
    xs = [torch.randn(8, 32) * 2.0**k for k in (0, 0, 4, 8)]
    return layer, xs


def test_each_cast_is_recorded_with_the_scale_it_used():
    layer, xs = layer_and_inputs()
    with Fp8Stats(nn.Sequential(layer)) as stats:
        for x in xs:
            layer(x.requires_grad_()).sum().backward()
    inputs = stats.series("0", "input")
    assert [r.step for r in inputs] == [0, 1, 2, 3]
    assert [r.amax for r in inputs] == [x.abs().max().item() for x in xs]
    fmax = torch.finfo(torch.float8_e4m3fn).max
    expected_scales, best = [1.0], 0.0
    for x in xs[:-1]:
        best = max(best, x.abs().max().item())
        expected_scales.append((torch.tensor(fmax) / torch.tensor(best)).item())
    assert [r.scale for r in inputs] == expected_scales
    for r, x in zip(inputs, xs):
        scaled = x * r.scale
        q = scaled.clamp(-fmax, fmax).to(torch.float8_e4m3fn).float()
        overflow = torch.isnan(quantize(scaled, "fp8_e4m3", saturate=False))  # rounds past max
        assert r.flushed == ((q == 0) & (x != 0)).sum().item() / x.numel()
        assert r.saturated == overflow.sum().item() / x.numel()
    assert inputs[-1].saturated > 0 and inputs[0].saturated == 0
    grads = stats.series("0", "grad_output")
    assert {r.format for r in grads} == {"fp8_e5m2"} and len(grads) == 4
    assert layer.observer is None  # detached on exit


def test_output_sqnr_is_against_the_same_layer_in_fp32():
    layer, xs = layer_and_inputs()
    stats = Fp8Stats(nn.Sequential(layer))
    with torch.no_grad():
        y = layer(xs[0])
    stats.detach()
    ref = F.linear(xs[0], layer.weight, layer.bias)
    assert stats.sqnr_by_layer() == {"0": sqnr(ref, y)}
    assert "output SQNR dB" in repr(stats.table())


def test_watching_a_model_without_fp8_layers_is_a_one_line_error():
    with pytest.raises(ValueError, match="no Fp8Linear layers.*convert_to_fp8"):
        Fp8Stats(nn.Linear(4, 4))


KW = dict(width=32, depth=1, n_head=2, batch_size=4, n_batches=2, seq_len=16)


def hand_loop(run: str, steps: int) -> list[float]:
    from ampnb.models import demo

    model, opt, loss_fn, batches = demo("gpt", seed=0, **KW)
    losses = []
    for x, y in itertools.islice(itertools.cycle(batches), steps):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=run == "bf16-mixed"):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_side_by_side_matches_hand_written_loops_and_restores_state():
    before = snapshot()
    result = side_by_side("gpt", steps=3, **KW)
    assert snapshot() == before
    assert list(result.losses) == ["32-true", "bf16-mixed", "fp8"]
    assert list(result.losses["32-true"]) == hand_loop("32-true", 3)
    assert list(result.losses["bf16-mixed"]) == hand_loop("bf16-mixed", 3)
    fp8 = result.losses["fp8"]
    assert fp8 != result.losses["bf16-mixed"]
    assert all(abs(a - b) < 0.1 for a, b in zip(fp8, result.losses["32-true"]))
    assert set(result.sqnr_by_layer()) == set(result.report.converted)
    assert "vs 32-true" in repr(result.table())


def test_side_by_side_rejects_unknown_runs_and_steps():
    with pytest.raises(ValueError, match="'fp4'.*allowed: 32-true, bf16-mixed, fp8"):
        side_by_side(runs=("fp4",))
    with pytest.raises(ValueError, match="steps=0"):
        side_by_side(steps=0)


def test_convert_report_lists_skipped_layers_for_the_demo():
    from ampnb.models import demo

    d = demo("gpt", **KW)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, report = convert_to_fp8(d.model)
    head = d.model.head
    assert [c.name for c in report.skipped] == ["head"]
    assert str(head.out_features) in report.skipped[0].reason and len(caught) == 1
