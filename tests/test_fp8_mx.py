"""MXFP8 training: convert_to_fp8(model, "mxfp8") against torchao's MX training path and
against the three GEMMs written out with ampnb.quantize's casts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampnb
from ampnb.fp8 import convert_to_fp8, revert_fp8
from ampnb.fp8.mx import MxLinear

mxfp8_linear = pytest.importorskip("torchao.prototype.moe_training.mxfp8_linear")


def q(t: torch.Tensor) -> torch.Tensor:
    return ampnb.quantize(t.contiguous(), "mxfp8_e4m3")


def torchao_step(x, w, g):
    """torchao's mx_mm (emulated kernels, FLOOR scales): output and both gradients."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y = mxfp8_linear._to_mxfp8_then_scaled_mm(x, w, KernelPreference.EMULATED,
                                                ScaleCalculationMode.FLOOR)
    y.backward(g)
    return y.detach(), x.grad, w.grad


def ours(backend, x, w, g):
    layer = nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        layer.weight.copy_(w)
    mx, report = convert_to_fp8(layer, "mxfp8", backend=backend)
    assert isinstance(mx, MxLinear) and report.backend == backend
    xx = x.detach().clone().requires_grad_()
    y = mx(xx)
    y.backward(g)
    assert mx.ran[backend] == 1
    return y.detach(), xx.grad, mx.weight.grad


@pytest.mark.parametrize("backend", ["ampnb", "torchao"])
def test_forward_and_backward_equal_torchaos_mx_path(backend):
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 96, generator=gen), torch.randn(32, 96, generator=gen) * 0.1
    x[3, 7] = 300.0  # an outlier: its block's scale, not the tensor's
    g = torch.randn(64, 32, generator=gen) * 1e-3
    for a, b in zip(ours(backend, x, w, g), torchao_step(x, w, g)):
        assert torch.equal(a, b)


def test_the_three_gemms_by_hand():
    """forward x @ w^T (blocks along K); grad_x = g @ w (along N); grad_w = g^T @ x (along M)."""
    gen = torch.Generator().manual_seed(1)
    x, w, g = torch.randn(40, 64, generator=gen), torch.randn(48, 64, generator=gen), \
        torch.randn(40, 48, generator=gen)
    y, gx, gw = ours("ampnb", x, w, g)  # 40 tokens: the last block along M is 8 long
    assert torch.equal(y, q(x) @ q(w).t())
    assert torch.equal(gx, q(g) @ q(w.t()).t())
    assert torch.equal(gw, q(g.t()) @ q(x.t()).t())
    assert not torch.equal(y, x @ w.t())  # MXFP8 is not fp32


def test_a_model_trains_and_reverts():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    mx, report = convert_to_fp8(model, "mxfp8", backend="ampnb")
    assert report.layers == ("0", "2") and "emulation" in report.reason
    assert isinstance(mx[0], MxLinear) and isinstance(model[0], nn.Linear)  # a copy by default
    assert set(mx.state_dict()) == set(model.state_dict())
    opt = torch.optim.SGD(mx.parameters(), lr=0.1)
    x, y = torch.randn(64, 32), torch.randn(64, 32)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = nn.functional.mse_loss(mx(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    back = revert_fp8(mx)
    assert isinstance(back[0], nn.Linear) and back[0].weight is mx[0].weight
    assert "mxfp8_e4m3" in repr(report)


def test_auto_says_which_backend_ran():
    _, report = convert_to_fp8(nn.Linear(32, 32), "mxfp8")
    assert report.backend == "torchao" and "torchao" in report.reason  # importable here


def test_fp16_and_ragged_shapes_fall_back_to_the_emulation():
    layer, _ = convert_to_fp8(nn.Linear(32, 32), "mxfp8", backend="torchao")
    layer(torch.randn(5, 32))  # 5 tokens: not a whole block along M
    assert layer.ran == {"ampnb": 1}


def test_bad_calls():
    with pytest.raises(ValueError, match="allowed: auto, torchao, ampnb"):
        convert_to_fp8(nn.Linear(32, 32), "mxfp8", backend="te")
    with pytest.raises(ValueError, match="allowed: backend= and inplace="):
        convert_to_fp8(nn.Linear(32, 32), "mxfp8", compile=True)
    with pytest.raises(ValueError, match="MXFP8"):
        convert_to_fp8(nn.LayerNorm(4), "mxfp8")


def test_the_mode_converts_and_steps():
    from ampnb.batch import as_batch
    from ampnb.step import train_step

    mode = ampnb.get_mode("transformer-engine-mxfp8")
    assert ampnb.get_mode("mxfp8") is mode and mode.param_dtype == torch.bfloat16
    assert mode.name not in ampnb.MODES  # by name only: the sweeps over every mode leave it out
    torch.manual_seed(0)
    model = mode.convert_module(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)))
    assert isinstance(model[0], MxLinear) and model[0].weight.dtype == torch.bfloat16
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = as_batch((torch.randn(32, 32), torch.randn(32, 32)), nn.functional.mse_loss)
    out = train_step(ampnb.Precision.of(mode, model=model), model, opt, batch,
                     nn.functional.mse_loss)
    assert torch.isfinite(out.loss) and sum(model[0].ran.values()) == 1
    assert mode.availability("cpu").ok and "MX" in mode.availability("cpu").reason
    with pytest.raises(ValueError, match="transformer-engine-mxfp8"):
        ampnb.get_mode("mxfp9")


def test_amp_cell_runs_the_mode():
    pytest.importorskip("IPython")
    from tests._magics_kit import amp, shell_with_ampnb

    gen = shell_with_ampnb()
    ip = next(gen)
    try:
        ip.user_ns["mk"] = lambda: nn.Linear(16, 32)
        amp(ip, "transformer-engine-mxfp8 -o r",
            "import ampnb\nm = ampnb.get_mode('mxfp8').convert_module(mk())\ny = m(x)")
        m = ip.user_ns["m"]
        assert isinstance(m, MxLinear) and m.weight.dtype == torch.bfloat16 and sum(m.ran.values()) == 1
        assert torch.isfinite(ip.user_ns["y"]).all() and "r" in ip.user_ns
    finally:
        for name in ("m", "mk", "ampnb"):
            ip.user_ns.pop(name, None)
        next(gen, None)
