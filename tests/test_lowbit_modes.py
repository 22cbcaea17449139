"""Lightning's bitsandbytes modes: the dynamic map, double quantization, LLM.int8(), layer replacement."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ampnb.lowbit import (
    LOWBIT_FORMATS,
    Linear4bit,
    Linear8bitLt,
    double_quant_saving,
    dynamic_map,
    get_lowbit,
    int8_split,
    int8_vectorwise_quant,
    quantize_blockwise,
    quantize_model,
    quantize_weight,
    roundtrip,
)
from ampnb.lowbit.formats import INV_127


def test_the_six_modes_are_lightnings():
    # lightning.fabric.plugins.precision.BitsandbytesPrecision(mode=...)
    assert list(LOWBIT_FORMATS) == ["nf4", "nf4-dq", "fp4", "fp4-dq", "int8", "int8-training"]


def decade_reference(signed: bool) -> list[float]:
    """The dynamic type from its definition: per decade 10^-6..10^0, linear fractions in (0.1, 1]."""
    values = [0.0, 1.0]
    for i, e in enumerate(range(-6, 1)):
        n = 2 ** i if signed else 2 ** (i + 1)  # the unsigned map spends the sign bit on fractions
        edges = torch.linspace(0.1, 1, n + 1, dtype=torch.float32)
        mids = ((edges[:-1] + edges[1:]) / 2 * 10.0 ** e).tolist()
        values += mids + ([-v for v in mids] if signed else [])
    return sorted(values)


@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_map_is_the_decimal_exponent_type(signed):
    m = dynamic_map(signed)
    assert m.numel() == 256 and m.unique().numel() == 256 and torch.equal(m, m.sort().values)
    ref = torch.tensor(decade_reference(signed), dtype=torch.float32)
    torch.testing.assert_close(m, ref, rtol=2e-7, atol=0)
    assert m.max() == 1.0 and (m == 0).sum() == 1 and (m.min() < 0) == signed


def argmin_quantize(x: torch.Tensor, code: torch.Tensor, blocksize: int):
    flat = torch.cat([x.reshape(-1), x.new_zeros((-x.numel()) % blocksize)]).reshape(-1, blocksize)
    absmax = flat.abs().amax(1)
    scaled = torch.clamp(flat * (1 / absmax)[:, None], -1, 1).reshape(-1)[: x.numel()]
    return (scaled[:, None] - code).abs().argmin(1).to(torch.uint8), absmax


@pytest.mark.parametrize("signed", [True, False])
def test_quantize_blockwise_equals_bitsandbytes_reference_argmin(signed):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g) * torch.logspace(-5, 0, 1000)  # many decades
    x = x if signed else x.abs()
    codes, absmax = quantize_blockwise(x, dynamic_map(signed), 256)
    ref_codes, ref_absmax = argmin_quantize(x, dynamic_map(signed), 256)
    assert torch.equal(codes, ref_codes) and torch.equal(absmax, ref_absmax)


@pytest.mark.parametrize("name", ["nf4-dq", "fp4-dq"])
def test_double_quantization_stores_the_absmax_in_the_dynamic_map(name):
    w = torch.randn(96, 700, generator=torch.Generator().manual_seed(3))  # 1050 blocks: 5 dq blocks
    plain, dq = quantize_weight(w, name.removesuffix("-dq")), quantize_weight(w, name)
    absmax = plain.absmax
    offset = absmax.mean()
    codes, absmax2 = argmin_quantize(absmax - offset, dynamic_map(True), 256)
    expected = dynamic_map(True)[codes.long()] * absmax2.repeat_interleave(256)[: absmax.numel()] + offset
    assert torch.equal(dq.dq.codes, codes) and torch.equal(dq.absmax, expected)
    # Not a linear int8 grid: the old approximation gave other scales.
    s2 = (absmax - offset).abs().max()
    linear = torch.round((absmax - offset) / s2 * 127) * s2 / 127 + offset
    assert not torch.allclose(dq.absmax, linear, rtol=0, atol=1e-7)
    assert torch.equal(dq.codes, plain.codes)  # codes come from the unquantized absmax


def test_double_quantization_saving_matches_lightnings_figure():
    saving = double_quant_saving()
    shape = (8192, 8192)
    measured = get_lowbit("nf4").bits_per_param(shape) - get_lowbit("nf4-dq").bits_per_param(shape)
    assert measured == pytest.approx(saving, abs=1e-6)  # one fp32 offset per tensor aside
    # Lightning's docs: "~0.37 bits per parameter", "about 3 GB for a 65B model".
    assert round(saving, 2) == 0.37 and round(65e9 * saving / 8 / 1e9) == 3


def test_int8_vectorwise_quant_sends_outlier_features_to_16_bits():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 32, generator=g)
    x[3, 5], x[0, 20] = 9.0, -7.0
    codes, stats, cols = int8_vectorwise_quant(x.half(), threshold=6.0)
    assert cols.tolist() == [5, 20]
    inl = x.half().float().clone()
    inl[inl.abs() >= 6] = 0  # outlier values leave the row absmax ...
    assert torch.equal(stats, inl.abs().amax(1))
    ref = torch.round(inl * (127 / inl.abs().amax(1, keepdim=True))).to(torch.int8)
    ref[:, [5, 20]] = 0  # ... and their whole columns take the 16-bit path
    assert torch.equal(codes, ref)
    _, _, none = int8_vectorwise_quant(x.half(), threshold=0.0)
    assert none.numel() == 0


def test_int8_split_decomposition_beats_all_int8_with_outlier_features():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 64, generator=g)
    x[:, 7] *= 30  # a systematic outlier feature, as LLM.int8() found in large models
    w = torch.randn(32, 64, generator=g) * 0.05
    split = int8_split(x, w)
    assert split.outlier_features == (7,) and split.threshold == 6.0
    assert split.sqnr_decomposed_db > split.sqnr_int8_only_db + 3
    assert "outlier features" in repr(split)
    with pytest.raises(ValueError, match="threshold=-1.*allowed"):
        int8_split(x, w, threshold=-1)


def test_linear4bit_forward_is_bitsandbytes_dequantize_then_matmul_in_compute_dtype():
    g = torch.Generator().manual_seed(3)
    lin = nn.Linear(64, 32)
    x = torch.randn(4, 64, generator=g)
    layer = Linear4bit(lin.weight, lin.bias, get_lowbit("nf4-dq"), torch.bfloat16)
    w = quantize_weight(lin.weight.detach().half(), "nf4-dq").dequantize().to(torch.bfloat16)
    expected = F.linear(x.bfloat16(), w, lin.bias.bfloat16()).float()
    assert torch.equal(layer(x), expected) and layer(x).dtype == torch.float32
    assert not any(p is lin.weight for p in layer.parameters())  # the 4-bit weight is frozen


@pytest.mark.parametrize("name", ["int8", "int8-training"])
def test_linear8bitlt_is_int8_inliers_plus_fp16_outliers(name):
    g = torch.Generator().manual_seed(4)
    lin = nn.Linear(32, 16)
    x = torch.randn(5, 32, generator=g)
    x[:, 3] *= 20
    layer = Linear8bitLt(lin.weight, lin.bias, get_lowbit(name))
    out = layer(x)
    assert layer.outlier_features == (3,)
    w16 = lin.weight.detach().half()
    rows = w16.float().abs().amax(1)
    wq = torch.round(w16.float() * (127 / rows[:, None]))
    # bitsandbytes: outlier *values* leave the row absmax, then the whole column's codes are 0.
    inl = x.half().float().clone()
    inl[inl.abs() >= 6] = 0
    sa = inl.abs().amax(1)
    xq = torch.round(inl * (127 / sa[:, None]))
    xq[:, 3] = 0
    inlier = (xq.double() @ wq.double().t()).float() * (sa[:, None] * rows[None, :]) * INV_127 ** 2
    w_out = w16 if name == "int8-training" else (wq * rows[:, None] * INV_127).half()
    expected = ((inlier + lin.bias.detach()).half().float()
                + x.half()[:, [3]].float() @ w_out[:, [3]].float().t())
    torch.testing.assert_close(out, expected, rtol=2e-3, atol=2e-3)


def test_int8_training_gradients_are_the_fp16_linear_gradients():
    g = torch.Generator().manual_seed(5)
    lin = nn.Linear(32, 16)
    layer = Linear8bitLt(lin.weight, lin.bias, get_lowbit("int8-training"))
    x = torch.randn(6, 32, generator=g, requires_grad=True)
    layer(x).sum().backward()
    x16 = x.detach().half().float()
    assert layer.weight16.grad is not None and layer.weight16.dtype == torch.float16
    torch.testing.assert_close(layer.weight16.grad.float(), torch.ones(6, 16).t() @ x16, rtol=1e-3, atol=1e-2)
    torch.testing.assert_close(x.grad, torch.ones(6, 16) @ lin.weight.detach().half().float(),
                               rtol=1e-3, atol=1e-3)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
        self.lm_head = nn.Linear(64, 10)

    def forward(self, x):
        return self.lm_head(self.body(x))


@pytest.mark.parametrize("mode", list(LOWBIT_FORMATS))
def test_quantize_model_replaces_each_linear_for_every_mode(mode):
    torch.manual_seed(6)
    model = Net()
    x = torch.randn(4, 64)
    q, report = quantize_model(model, mode, inputs=x)
    kinds = {type(m).__name__ for m in q.modules()}
    assert kinds >= {"Linear4bit" if get_lowbit(mode).is_4bit else "Linear8bitLt"}
    assert "Linear" not in kinds and all(isinstance(m, nn.Linear) for m in (model.lm_head, model.body[0]))
    assert report.dtype == (torch.float16 if mode.startswith("int8") else torch.bfloat16)
    assert [e.name for e in report.layers] == ["body.0", "body.2", "lm_head"]
    assert all(e.output_sqnr_db > 10 for e in report.layers)
    assert q(x).dtype == torch.float32
    trainable = {n for n, p in q.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in q.named_parameters()}
    assert any(n.endswith("weight16") for n in trainable) == (mode == "int8-training")


def test_ignore_modules_and_dtype_are_lightnings_arguments():
    torch.manual_seed(7)
    model = Net()
    q, report = quantize_model(model, "nf4", dtype=torch.float16, ignore_modules={"lm_head"})
    assert type(q.lm_head) is nn.Linear and torch.equal(q.lm_head.weight, model.lm_head.weight)
    assert q.body[0].compute_dtype == torch.float16 and [e.name for e in report.layers] == ["body.0", "body.2"]
    with pytest.raises(ValueError, match="dtype=torch.bfloat16 is not allowed for 'int8'.*float16"):
        quantize_model(model, "int8", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="ignore_modules='lm_head' is not allowed.*set"):
        quantize_model(model, "nf4", ignore_modules="lm_head")
    with pytest.raises(ValueError, match="no Linear or Conv1D layers outside ignore_modules"):
        quantize_model(model, "nf4", ignore_modules={"body", "lm_head"})


def test_a_converted_model_is_not_replaced_again():
    torch.manual_seed(8)
    q, _ = quantize_model(Net(), "nf4", inplace=False)
    layers = [m for m in q.modules() if isinstance(m, Linear4bit)]
    again, report = quantize_model(q, "int8-training", dtype=torch.float16, inplace=True)
    assert again is q and [m for m in q.modules() if isinstance(m, Linear4bit)] == layers
    assert all(m.compute_dtype == torch.float16 for m in layers)  # Lightning sets compute_dtype
    assert report.already and "none replaced" in repr(report)
    assert all(e.bits_per_param == get_lowbit("nf4").bits_per_param(e.shape) for e in report.layers)


@pytest.mark.parametrize("mode", list(LOWBIT_FORMATS))
def test_roundtrip_without_bitsandbytes_is_the_emulation(mode):
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(9))
    assert torch.equal(roundtrip(w, mode), roundtrip(w, mode, use_bitsandbytes=False))
    assert math.isfinite(get_lowbit(mode).bits_per_param(w.shape))


@pytest.mark.parametrize("mode", ["int8", "int8-training"])
def test_report_names_the_features_that_went_the_fp16_path(mode):
    torch.manual_seed(10)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    x = torch.randn(6, 32)
    x[2, 11] = 8.0  # one value past the threshold: feature 11 of the first layer's input
    _, report = quantize_model(model, mode, inputs=x)
    hidden = torch.relu(model[0](x))
    expected = tuple(torch.argwhere((hidden.half().abs() >= 6).any(0)).view(-1).tolist())
    assert [e.outlier_features for e in report.layers] == [(11,), expected]
    assert "fp16 features" in repr(report) and "|x| >= 6" in repr(report)
    _, nf4 = quantize_model(model, "nf4", inputs=x)
    assert "fp16 features" not in repr(nf4)


def test_an_all_zero_row_quantizes_to_zero_codes_not_nan():
    from ampnb.lowbit.formats import int8_rowwise

    rows = torch.tensor([[0.0, 0.0, 0.0], [1.0, -2.0, 0.5]])
    codes, stats = int8_rowwise(rows)
    assert codes[0].tolist() == [0, 0, 0] and codes[1].tolist() == [64, -127, 32]
    assert stats.tolist() == [0.0, 2.0]
