"""transformers' Conv1D (GPT-2's projections, weight stored (in, out)) in FP8 and low-bit formats."""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from ampnb.formats import quantize
from ampnb.fp8 import CONVERTIBLE, Fp8Linear, convert_to_fp8, fp8_autocast, plan, revert_fp8
from ampnb.lowbit import quantize_model, roundtrip

Conv1D = pytest.importorskip("transformers.pytorch_utils").Conv1D
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def conv(n_in: int = 64, n_out: int = 32) -> nn.Module:
    torch.manual_seed(0)
    layer = Conv1D(n_out, n_in)  # Conv1D(nf=out, nx=in)
    with torch.no_grad():
        layer.bias.normal_()
    return layer


def fp8(x: torch.Tensor, fmt: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x scaled by its dynamic scale and rounded by ampnb.quantize, checked against torch's cast."""
    scale = (torch.finfo(dtype).max / x.detach().abs().amax().double()).float()
    q = quantize(x.float() * scale, fmt, saturate=True)
    fmax = torch.finfo(dtype).max
    assert torch.equal(q, (x.float() * scale).clamp(-fmax, fmax).to(dtype).float())
    return q, scale


def test_both_layer_types_are_registered():
    assert list(CONVERTIBLE) == ["Linear", "Conv1D"]
    assert [k.transposed for k in CONVERTIBLE.values()] == [False, True]


def test_converted_conv1d_forward_equals_a_hand_fp8_computation():
    layer = conv()
    x = torch.randn(2, 5, 64) * 3
    m, report = convert_to_fp8(nn.Sequential(layer), "tensorwise", matmul="dequantize")
    assert isinstance(m[0], Fp8Linear) and m[0].transposed
    assert report.converted == ("0",) and report.layers[0].kind == "Conv1D"
    assert (report.layers[0].in_features, report.layers[0].out_features) == (64, 32)
    y = m(x)
    qx, sx = fp8(x.reshape(-1, 64), "fp8_e4m3", E4M3)
    qw, sw = fp8(layer.weight, "fp8_e4m3", E4M3)  # stored (in, out): y = x @ W + b
    expected = ((qx / sx) @ (qw / sw) + layer.bias).reshape(2, 5, 32)
    assert torch.equal(y, expected)
    assert not torch.equal(y, layer(x))  # really FP8: the unconverted Conv1D differs
    torch.testing.assert_close(y, layer(x), rtol=0.2, atol=0.5)


def test_conv1d_gradients_equal_those_of_the_same_linear_in_fp8():
    layer = conv()
    linear = nn.Linear(64, 32)
    with torch.no_grad():
        linear.weight.copy_(layer.weight.t())
        linear.bias.copy_(layer.bias)
    x = torch.randn(6, 64)
    grad = torch.randn(6, 32) * 1e-3
    outs = []
    for source in (layer, linear):
        m = Fp8Linear.from_linear(copy.deepcopy(source), "tensorwise", matmul="dequantize")
        xi = x.clone().requires_grad_()
        y = m(xi)
        y.backward(grad)
        outs.append((y, xi.grad, m.weight.grad, m.bias.grad))
    (y1, gx1, gw1, gb1), (y2, gx2, gw2, gb2) = outs
    # Same FP8 values; only the memory layout of W (so the fp32 summation order) differs.
    close = dict(rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(y1, y2, **close)
    torch.testing.assert_close(gx1, gx2, **close)
    assert gw1.shape == (64, 32) and gw1.is_contiguous()
    torch.testing.assert_close(gw1, gw2.t(), **close)
    assert torch.equal(gb1, gb2)


def test_outside_fp8_autocast_a_conv1d_computes_exactly_and_reverts_to_itself():
    layer = conv()
    x = torch.randn(3, 64)
    model = nn.Sequential(layer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert_to_fp8(model, inplace=True, enabled=None)
    assert torch.equal(model(x), layer(x))
    with fp8_autocast():
        assert not torch.equal(model(x), layer(x))
    weight = model[0].weight
    revert_fp8(model)
    assert model[0] is layer and layer.weight is weight


def test_the_error_blames_the_conv1d_layers_and_names_what_else_was_left_out():
    model = nn.Sequential(nn.Embedding(10, 12), Conv1D(36, 12), nn.LayerNorm(36))
    predicted = plan(model)
    assert [(c.name, c.kind) for c in predicted.skipped] == [("1", "Conv1D")]
    assert predicted.left_out == (("Embedding", 1), ("LayerNorm", 1))
    with pytest.raises(ValueError, match=r"'1' \(Conv1D 12→36: in_features 12 is not a multiple "
                                         r"of 8 and out_features 36.*left out: 1 Embedding, "
                                         r"1 LayerNorm"):
        convert_to_fp8(model, inplace=True)
    assert isinstance(model[1], Conv1D)


def test_int8_quantizes_a_conv1d_per_output_row_as_a_linear():
    layer = conv(64, 128)
    q, report = quantize_model(nn.Sequential(layer), "int8")
    (e,) = report.layers
    assert (e.name, e.kind, e.shape) == ("0", "Conv1D", (128, 64))
    # bitsandbytes quantizes the fp16 weight (as Lightning does) in the (out, in) layout.
    assert torch.equal(q[0].weight, roundtrip(layer.weight.t().half(), "int8").t())
    assert not torch.equal(q[0].weight, roundtrip(layer.weight.half(), "int8"))  # the layout matters
    assert report.quantized == (("Conv1D", 1),)


def test_recognising_conv1d_never_imports_transformers():
    code = ("import sys, torch; from torch import nn\n"
            "from ampnb.fp8 import plan; from ampnb.lowbit import quantize_model\n"
            "m = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16))\n"
            "assert plan(m).converted == ('0',); quantize_model(m, 'nf4')\n"
            "assert 'transformers' not in sys.modules, 'imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)
