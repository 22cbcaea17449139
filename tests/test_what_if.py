"""what_if: per layer, tensor and format, against torchao's compute_error on torchao's casts
and on tensors taken by hand from a plain fp32 step; the user's model and torch state kept."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import ampnb
from ampnb.putback_state import torch_state
from ampnb.whatif import DEFAULT_FORMATS, WhatIf, get_cast

torchao_utils = pytest.importorskip("torchao.float8.float8_utils")
mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")


def small_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 32))


def batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 64, generator=g), torch.randn(8, 32, generator=g)


def by_hand(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[tuple[str, str], torch.Tensor]:
    """Each Linear's weight, input and output gradient from a plain fp32 step (no ampnb)."""
    seen: dict[tuple[str, str], torch.Tensor] = {}
    handles = []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            def hook(m, args, out, name=name):
                seen[(name, "weight")] = m.weight.detach().clone()
                seen[(name, "input")] = args[0].detach().clone()
                out.register_hook(lambda g: seen.__setitem__((name, "grad_output"), g.clone()))
            handles.append(m.register_forward_hook(hook))
    nn.functional.mse_loss(model(x), y).backward()
    for h in handles:
        h.remove()
    model.zero_grad(set_to_none=True)
    return seen


def test_rows_are_compute_error_on_torchaos_casts():
    model, (x, y) = small_mlp(), batch()
    result = ampnb.what_if(model, (x, y), nn.functional.mse_loss,
                           formats=["bf16", "mxfp8_e4m3", "mxfp4"])
    tensors = by_hand(small_mlp(), x, y)
    assert len(result.rows) == 2 * 3 * 3 and result.modules == ("0", "2")
    ref = {"bf16": lambda t: t.bfloat16().float(),
           "mxfp8_e4m3": lambda t: mx.MXTensor.to_mx(t, torch.float8_e4m3fn, 32).dequantize(torch.float32),
           "mxfp4": lambda t: mx.MXTensor.to_mx(t, torch.float4_e2m1fn_x2, 32).dequantize(torch.float32)}
    for (module, tensor), t in tensors.items():
        for fmt, cast in ref.items():
            row = result.get(module, tensor, fmt)
            q = cast(t)
            expected = torchao_utils.compute_error(t.double(), q.double()).item()
            assert row.sqnr_db == pytest.approx(expected, abs=1e-5), (module, tensor, fmt)
            assert row.underflow == ((t != 0) & (q == 0)).sum().item() / t.numel()
            assert row.numel == t.numel()


def test_fp8_scaled_casts_are_torchaos():
    """Tensorwise: max/amax (torchao's amax_to_scale); rowwise: per row, rounded down to 2**k."""
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(3)) * 7
    e4m3 = torch.float8_e4m3fn
    for name, kwargs, dim in (("fp8_e4m3_tensorwise", {}, None),
                              ("fp8_e4m3_rowwise", {"round_scales_to_power_of_2": True}, -1)):
        amax = x.abs().amax() if dim is None else x.abs().amax(dim, keepdim=True)
        scale = torchao_utils.amax_to_scale(amax, e4m3, **kwargs)
        expected = (x * scale).clamp(-448, 448).to(e4m3).float() / scale
        y, over = get_cast(name)(x)
        assert torch.equal(y, expected) and over == 0


def test_underflow_and_overflow_by_hand():
    """fp16: 1e5 rounds past 65504 (overflow), 1e-8 below half its 2**-24 (underflow)."""
    layer = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1e5, 1e-8, 1.0, 0.0]]))
    r = ampnb.what_if(layer, torch.ones(2, 4), formats=["fp16"]).get("", "weight", "fp16")
    assert (r.overflow, r.underflow) == (1 / 4, 1 / 4)
    assert r.sqnr_db == -math.inf  # an inf in the copy: the error is infinite


def test_model_and_torch_state_untouched():
    model, (x, y) = small_mlp(), batch()
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    params = [p.detach().clone() for p in model.parameters()]
    before, rng = torch_state(), torch.random.get_rng_state()
    ampnb.what_if(model, (x, y), nn.functional.mse_loss)
    assert torch_state() == before and torch.equal(torch.random.get_rng_state(), rng)
    assert all(torch.equal(p, q) and torch.equal(p.grad, torch.full_like(p, 0.5))
               for p, q in zip(model.parameters(), params))
    assert not any(m._forward_hooks for m in model.modules())


def test_a_raising_loss_leaves_no_hooks():
    model, (x, y) = small_mlp(), batch()

    def bad_loss(out, target):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        ampnb.what_if(model, (x, y), bad_loss)
    assert not any(m._forward_hooks for m in model.modules())
    assert all(p.grad is None for p in model.parameters())


def test_convolutions_block_along_channels():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(32, 32, 3, padding=1), nn.Flatten(), nn.Linear(32 * 16, 4))
    x = torch.randn(2, 32, 4, 4)
    result = ampnb.what_if(model, (x, torch.randn(2, 4)), nn.functional.mse_loss,
                           formats=["mxfp8_e4m3"])
    assert {r.tensor for r in result.rows if r.module == "0"} == {"weight", "input", "grad_output"}
    t = x.movedim(1, -1).contiguous()
    q = mx.MXTensor.to_mx(t, torch.float8_e4m3fn, 32).dequantize(torch.float32)
    expected = torchao_utils.compute_error(t.double(), q.double()).item()
    assert result.get("0", "input", "mxfp8_e4m3").sqnr_db == pytest.approx(expected, abs=1e-5)


def test_transformers_conv1d():
    Conv1D = pytest.importorskip("transformers.pytorch_utils").Conv1D
    torch.manual_seed(0)
    layer = Conv1D(48, 64)  # (nf=out, nx=in): weight stored (in, out)
    result = ampnb.what_if(layer, torch.randn(4, 64), formats=["mxfp4"])  # no loss: no grads
    assert {r.tensor for r in result.rows} == {"weight", "input"}
    w = layer.weight.detach().t().contiguous()  # blocks along in, as nn.Linear's
    q = mx.MXTensor.to_mx(w, torch.float4_e2m1fn_x2, 32).dequantize(torch.float32)
    expected = torchao_utils.compute_error(w.double(), q.double()).item()
    assert result.get("", "weight", "mxfp4").sqnr_db == pytest.approx(expected, abs=1e-5)


def test_model_own_loss_and_table():
    demo = ampnb.models.demo("gpt")
    result = demo.model and ampnb.what_if(demo.model, demo.batches[0], demo.loss_fn)
    assert isinstance(result, WhatIf) and result.formats == DEFAULT_FORMATS
    html = result._repr_html_()
    assert all(f in html for f in DEFAULT_FORMATS) and "SQNR" in html
    assert "underflow" not in repr(result.table("sqnr_db")) and "flushed" in repr(
        result.table("underflow"))
    layer = result.modules[0]
    assert result.value(layer, "fp16") > result.value(layer, "mxfp4")  # 10 mantissa bits vs 1


@pytest.mark.parametrize("bad, match", [
    ({"formats": ["fp12"]}, "allowed: .*mxfp4"), ({"formats": []}, "empty"),
    ({"formats": ["fp8_e4m3_blockwise"]}, "fp8_e4m3_tensorwise")])
def test_bad_formats(bad, match):
    model, b = small_mlp(), batch()
    with pytest.raises(ValueError, match=match):
        ampnb.what_if(model, b, nn.functional.mse_loss, **bad)


def test_bad_models():
    with pytest.raises(ValueError, match="nn.Module"):
        ampnb.what_if(lambda x: x, torch.ones(2))
    with pytest.raises(ValueError, match="no Linear or Conv"):
        ampnb.what_if(nn.LayerNorm(4), (torch.ones(2, 4), None), lambda out, _t: out.sum())


def test_heat_map():
    matplotlib = pytest.importorskip("matplotlib")
    from ampnb.plots import plot_what_if

    model, b = small_mlp(), batch()
    result = ampnb.what_if(model, b, nn.functional.mse_loss, formats=["bf16", "mxfp4"])
    ax = plot_what_if(result)
    assert isinstance(ax, matplotlib.axes.Axes)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["bf16", "mxfp4"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0", "2"]
    ax = plot_what_if(result, stat="underflow", tensors=("grad_output",))
    assert ax.get_title().startswith("what if")
