"""The lean emulation (#34): FP8 kept for backward, torch's own casts, exact widening, fixed state."""

from __future__ import annotations

import pytest
import torch

from ampnb.fp8 import Fp8Linear
from ampnb.fp8.scaling import widen

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@pytest.mark.parametrize("dtype", FP8)
def test_widen_equals_torchs_own_conversion_for_every_bit_pattern(dtype):
    q = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    ours, torchs = widen(q), q.float()
    nan = torchs.isnan()
    assert torch.equal(ours.isnan(), nan)  # e4m3fn's two NaN patterns stay NaN
    assert torch.equal(ours[~nan], torchs[~nan])
    assert torch.equal(ours[~nan].signbit(), torchs[~nan].signbit())  # -0 stays -0


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_backward_keeps_fp8_tensors_and_scales_not_float32_copies(recipe):
    layer = Fp8Linear(64, 32, recipe=recipe)
    saved = []

    def pack(t):
        saved.append((t.dtype, t.dim()))
        return t

    x = torch.randn(16, 64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    assert saved, "the FP8 matmul saved nothing"
    # Activations and weights as one byte a value; the only float32 tensors are 0-dim scales.
    for dtype, dim in saved:
        assert dtype in FP8 or (dtype == torch.float32 and dim == 0), (dtype, dim)
    y.sum().backward()
    assert x.grad is not None and layer.weight.grad is not None


def test_a_nan_in_the_input_reaches_the_output_under_delayed_scaling():
    layer = Fp8Linear(16, 16)  # delayed: the scale comes from earlier steps and stays finite
    layer(torch.randn(4, 16))
    x = torch.randn(4, 16)
    x[1, 3] = float("nan")
    y = layer(x)
    assert y[1].isnan().all() and not y[[0, 2, 3]].isnan().any()


def test_state_does_not_grow_with_steps():
    layer = Fp8Linear(16, 16)
    shapes = [(b.shape, b.dtype) for b in layer.buffers()]
    for _ in range(3 * layer.recipe.amax_history_len // 256 + 5):
        layer(torch.randn(4, 16, requires_grad=True)).sum().backward()
    assert [(b.shape, b.dtype) for b in layer.buffers()] == shapes
