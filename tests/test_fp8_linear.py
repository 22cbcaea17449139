"""Emulated FP8 Linear against a dequantize-then-fp32 reference; conversion of whole models."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from ampnb.fp8 import Fp8Linear, convert_to_fp8, fp8_autocast, fp8_report, plan, revert_fp8
from ampnb.putback_state import torch_state as snapshot

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def fp8(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """Torch's own saturating FP8 cast of x * scale, dequantized to fp32."""
    fmax = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-fmax, fmax).to(dtype).float() / scale


def dynamic_scale(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (torch.finfo(dtype).max / x.detach().abs().amax().double()).float()


def reference(x, weight, bias, grad, grad_dtype):
    """Forward and gradients computed in fp32 from dequantized FP8 values (tensorwise scales)."""
    x2, g2 = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
    dx = fp8(x2, E4M3, dynamic_scale(x2, E4M3))
    dw = fp8(weight, E4M3, dynamic_scale(weight, E4M3))
    dg = fp8(g2, grad_dtype, dynamic_scale(g2, grad_dtype))
    y = dx @ dw.t() + (0 if bias is None else bias)
    grads = (dg @ dw).reshape(x.shape), dg.t() @ dx, None if bias is None else g2.sum(0)
    return y.reshape(*x.shape[:-1], -1), grads


@pytest.mark.parametrize(("recipe", "grad_dtype"), [("tensorwise", E5M2), ("e4m3-dynamic", E4M3)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(6, 32), (2, 5, 32)])
def test_forward_and_gradients_equal_the_dequantized_fp32_reference(recipe, grad_dtype, bias, shape):
    torch.manual_seed(0)
    plain = nn.Linear(32, 16, bias=bias)
    layer = Fp8Linear.from_linear(copy.deepcopy(plain), recipe, matmul="dequantize")
    x = (torch.randn(shape) * 3).requires_grad_()
    grad = torch.randn(*shape[:-1], 16) * 1e-3
    y = layer(x)
    y.backward(grad)
    ref_y, (gx, gw, gb) = reference(x.detach(), plain.weight.detach(),
                                    None if plain.bias is None else plain.bias.detach(), grad,
                                    grad_dtype)
    assert torch.equal(y, ref_y)
    assert torch.equal(x.grad, gx) and torch.equal(layer.weight.grad, gw)
    assert (layer.bias is None and gb is None) or torch.equal(layer.bias.grad, gb)
    # And it is really FP8: it differs from the fp32 layer.
    assert not torch.equal(y, plain(x))


def test_scaled_mm_path_agrees_with_dequantize_path():
    torch.manual_seed(1)
    base = nn.Linear(32, 16)
    x = torch.randn(8, 32)
    outs, grads = [], []
    for mm in ("dequantize", "scaled_mm"):
        layer = Fp8Linear.from_linear(copy.deepcopy(base), "tensorwise", matmul=mm)
        xi = x.clone().requires_grad_()
        try:
            y = layer(xi)
        except RuntimeError as err:  # _scaled_mm is not in every build
            pytest.skip(f"torch._scaled_mm does not run here: {err}")
        y.backward(torch.ones_like(y))
        outs.append(y)
        grads.append((xi.grad, layer.weight.grad))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-5)


def test_output_follows_autocast_dtype_and_state_is_restored():
    layer = Fp8Linear(32, 16, recipe="tensorwise")
    before = snapshot()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(torch.randn(4, 32))
    assert y.dtype == torch.bfloat16 and snapshot() == before
    with pytest.raises(RuntimeError, match="boom"), torch.autocast("cpu", dtype=torch.bfloat16):
        layer(torch.randn(4, 32))
        raise RuntimeError("boom")
    assert snapshot() == before


def test_context_following_layers_are_exact_outside_fp8_autocast():
    torch.manual_seed(2)
    plain = nn.Linear(32, 16)
    layer = Fp8Linear.from_linear(plain, "tensorwise", enabled=None)
    x = torch.randn(4, 32)
    assert torch.equal(layer(x), plain(x)) and not layer.fp8_now
    with fp8_autocast():
        assert layer.fp8_now and not torch.equal(layer(x), plain(x))
        with fp8_autocast(False):
            assert torch.equal(layer(x), plain(x))
    assert not layer.fp8_now
    with pytest.raises(ValueError, match="enabled='yes'"):
        with fp8_autocast("yes"):
            pass


def test_casting_the_module_keeps_scales_in_float32():
    layer = Fp8Linear(32, 16)
    layer(torch.randn(4, 32) * 3)
    scale = layer.scale.clone()
    layer.to(torch.bfloat16)
    assert layer.weight.dtype == torch.bfloat16
    assert layer.scale.dtype == torch.float32 and torch.equal(layer.scale, scale)


def mlp() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 64), nn.ReLU(),
                         nn.Linear(64, 5))


def test_convert_swaps_only_aligned_layers_and_warns_about_the_rest():
    model = mlp()
    predicted = plan(model)
    with pytest.warns(UserWarning, match=r"2 linear layer\(s\).*'0' \(Linear 10→32: in_features 10.*'4'"):
        fp8_model, report = convert_to_fp8(model)
    assert report.converted == predicted.converted == ("2",)
    assert isinstance(fp8_model[2], Fp8Linear) and isinstance(model[2], nn.Linear)
    assert fp8_model[2].weight is not model[2].weight  # a copy: the original stays fp32
    assert set(fp8_model.state_dict()) == set(model.state_dict())
    assert "1 of 3 linear layers in FP8" in repr(report)


def test_inplace_convert_shares_parameters_and_revert_gives_the_same_model():
    model = mlp()
    params = list(model.parameters())
    x = torch.randn(4, 10)
    y = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        same, _ = convert_to_fp8(model, inplace=True)
        again, report = convert_to_fp8(model, inplace=True)  # converting twice changes nothing
    assert same is model and again is model and report.converted == ("2",)
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    revert_fp8(model)
    assert fp8_report(model).converted == () and torch.equal(model(x), y)


def test_a_model_no_fp8_gemm_can_take_raises_and_stays_as_it_was():
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh())
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"'0' \(Linear 3→5: in_features 3 is not a multiple of 8"):
        convert_to_fp8(model, inplace=True)
    assert isinstance(model[0], nn.Linear)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="no Linear or Conv1D layers"):
        convert_to_fp8(nn.Sequential(nn.ReLU()))


@pytest.mark.parametrize(("kw", "match"), [
    (dict(matmul="fast"), "matmul='fast'.*allowed: auto, dequantize, scaled_mm"),
    (dict(recipe="fastest"), "'fastest'.*allowed"),
    (dict(enabled=1), "enabled=1"),
])
def test_bad_arguments_are_one_line_errors_and_leave_the_model_alone(kw, match):
    model = mlp()
    with pytest.raises(ValueError, match=match):
        convert_to_fp8(model, inplace=True, **kw)
    assert fp8_report(model).converted == ()


def test_a_bare_linear_layer_converts():
    layer, report = convert_to_fp8(nn.Linear(16, 32))
    assert isinstance(layer, Fp8Linear) and report.converted == ("",)


def test_without_saturation_gradients_past_e5m2_max_overflow_to_inf():
    from ampnb.fp8 import Fp8Recipe

    layer = Fp8Linear(16, 16, recipe=Fp8Recipe(saturate=False), matmul="dequantize")
    x = torch.randn(4, 16).requires_grad_()
    y = layer(x)  # first step: TE's initial scale 1, so the cast sees the raw gradient
    y.backward(torch.full_like(y, 1e5))  # past e5m2's max (57344): torch's cast gives inf
    assert not torch.isfinite(x.grad).any()  # inf gradients; inf - inf in the matmul gives NaN
    assert torch.isinf(torch.tensor(1e5).to(torch.float8_e5m2).float())
    saturating = Fp8Linear(16, 16, matmul="dequantize")  # the default recipe saturates
    y = saturating(x.detach().requires_grad_())
    y.backward(torch.full_like(y, 1e5))
    assert torch.isfinite(saturating.weight.grad).all()


def test_layers_that_are_never_called_or_have_their_own_forward_are_left_out():
    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    model = nn.Sequential(nn.MultiheadAttention(32, 2), Scaled(32, 32), nn.Linear(32, 32))
    report = plan(model)
    # nn.MultiheadAttention uses out_proj.weight directly: swapping it would change nothing.
    assert report.converted == ("2",)
    assert dict(report.left_out) == {"MultiheadAttention": 1, "NonDynamicallyQuantizableLinear": 1}
    # The subclass is a layer row with its true reason, not 'not Linear or Conv1D' (#34).
    (scaled,) = report.skipped
    assert scaled.name == "1" and "Scaled has its own forward" in scaled.reason
