"""Gradient statistics of the stepper against torch's own reductions, edge cases included."""

from __future__ import annotations

import math

import pytest
import torch

from ampnb.scaler.records import flat_grads, measure, stats_of

INF, NAN = math.inf, math.nan
CASES = {
    "plain": [0.5, -3.0, 2.0**-20, 7.0],
    "exact zeros": [0.0, -0.0, 1e-3, -4.0, 0.0],
    "all zero": [0.0, -0.0, 0.0],
    "negative largest": [-9.0, 1.0, 2.0],
    "fp32 subnormal": [1e-45, 0.0, -1.0],
    "inf": [1.0, INF, -2.0, 0.0],
    "-inf and nan": [-INF, NAN, 0.25, 0.0],
    "only nan": [NAN, NAN],
}


def _reference(flat: torch.Tensor) -> tuple[float, float, float, int]:
    """The same figures from plain torch reductions over a boolean mask (slow, obvious)."""
    finite = flat[torch.isfinite(flat)].abs()
    nonzero = finite[finite > 0]
    return (torch.linalg.vector_norm(flat).item(),
            finite.max().item() if finite.numel() else 0.0,
            nonzero.min().item() if nonzero.numel() else 0.0,
            int((~torch.isfinite(flat)).sum()))


@pytest.mark.parametrize("case", list(CASES))
def test_stats_match_torch_reductions(case):
    flat = torch.tensor(CASES[case], dtype=torch.float32)
    norm, top, low, nonfinite = _reference(flat)
    stats = stats_of(flat, smallest=True)
    assert (stats.max_abs, stats.min_abs_nonzero, stats.nonfinite) == (top, low, nonfinite)
    assert stats.numel == flat.numel()
    assert stats.norm == norm or (math.isnan(stats.norm) and math.isnan(norm))
    assert math.copysign(1.0, stats.max_abs) == 1.0  # never "-0"
    quick = stats_of(flat)  # without the smallest nonzero |g|: same figures otherwise
    assert quick.min_abs_nonzero is None
    assert (quick.max_abs, quick.nonfinite) == (top, nonfinite)


def test_flags_come_back_with_the_statistics():
    flat = torch.tensor([3.0, -4.0])
    flags = [torch.tensor(1.0), torch.tensor([0.0], dtype=torch.float64), torch.tensor(2.5).half()]
    stats, values = measure(flat, flags=flags)
    assert values == [f.item() for f in flags]
    assert stats.norm == torch.linalg.vector_norm(flat).item()
    assert measure(None, flags=flags) == (None, values)


def test_flat_grads_is_a_copy_in_parameter_order():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model(torch.randn(5, 3)).sum().backward()
    model[1].bias.grad = None  # a parameter without a gradient is left out
    params = list(model.parameters())
    flat = flat_grads(params)
    expected = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])
    assert torch.equal(flat, expected)
    flat.zero_()
    assert params[0].grad.abs().sum() > 0
    assert flat_grads([torch.nn.Parameter(torch.ones(2))]) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flags_on_a_gpu_are_read_in_one_stacked_transfer():
    flat = torch.tensor([3.0, -4.0, 0.0], device="cuda")
    loss = (torch.ones(2, device="cuda", requires_grad=True) * 2.5).sum().half()
    stats, values = measure(flat, smallest=True, flags=[loss, torch.tensor([1.0], device="cuda")])
    assert values == [5.0, 1.0]
    assert (stats.norm, stats.max_abs, stats.min_abs_nonzero) == (5.0, 4.0, 3.0)
