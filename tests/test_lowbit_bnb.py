"""The emulation against bitsandbytes itself, where it imports (CUDA, or its CPU backend)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampnb.lowbit import (
    Adam8bit,
    dynamic_map,
    get_lowbit,
    quantize_blockwise,
    quantize_model,
    quantize_weight,
)
from ampnb.lowbit.int8 import int8_vectorwise_quant

bnb = pytest.importorskip("bitsandbytes")
F = pytest.importorskip("bitsandbytes.functional")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="bitsandbytes' layers need CUDA")


def weights(seed: int = 0, shape: tuple[int, int] = (96, 700)) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.05


def on_device(fn, *args, **kw):
    """Run a bitsandbytes call; skip where its build has no kernel for this device."""
    try:
        return fn(*args, **kw)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"bitsandbytes has no {DEVICE} kernel here: {e}")


@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_map_equals_bitsandbytes(signed):
    assert torch.equal(dynamic_map(signed), F.create_dynamic_map(signed=signed).cpu())


def test_quantize_blockwise_equals_bitsandbytes():
    x = weights(1).reshape(-1)
    codes, state = on_device(F.quantize_blockwise, x.to(DEVICE), blocksize=256)
    ours, absmax = quantize_blockwise(x, dynamic_map(True), 256)
    assert torch.equal(absmax, state.absmax.cpu())
    assert (ours != codes.cpu()).float().mean() < 1e-4  # ties at a midpoint may differ by one code


@pytest.mark.parametrize("mode", ["nf4", "nf4-dq", "fp4", "fp4-dq"])
def test_4bit_quantize_dequantize_equals_bitsandbytes(mode):
    f = get_lowbit(mode)
    w = weights(2).half()
    packed, state = on_device(F.quantize_4bit, w.to(DEVICE), blocksize=64,
                              compress_statistics=f.double_quant, quant_type=f.quant_type)
    ours = quantize_weight(w, mode)
    packed = packed.reshape(-1).cpu()
    codes = torch.stack([packed >> 4, packed & 0xF], 1).reshape(-1)[: w.numel()]
    assert (codes != ours.codes).float().mean() < 1e-4
    if f.double_quant:
        assert torch.equal(state.absmax.cpu(), ours.dq.codes)
        assert torch.equal(state.state2.absmax.cpu(), ours.dq.absmax2)
        assert torch.equal(torch.as_tensor(state.offset).cpu().reshape(()), ours.dq.offset.reshape(()))
    else:
        assert torch.equal(state.absmax.cpu(), ours.absmax)
    back = F.dequantize_4bit(packed.reshape(-1, 1).to(DEVICE), state).cpu()
    same = back == ours.dequantize()
    assert same.float().mean() > 1 - 1e-4


def test_int8_vectorwise_quant_equals_bitsandbytes():
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(3)).half()
    x[:, 9] *= 20
    codes, stats, cols = on_device(F.int8_vectorwise_quant, x.to(DEVICE).clone(), threshold=6.0)
    ours = int8_vectorwise_quant(x, 6.0)
    assert torch.equal(ours[0], codes.cpu()) and torch.equal(ours[1], stats.cpu())
    assert torch.equal(ours[2], cols.cpu())


@needs_cuda
def test_adam8bit_follows_bitsandbytes_adam8bit():
    p0 = weights(4, (64, 128))
    g = torch.Generator().manual_seed(5)
    grads = [torch.randn(p0.shape, generator=g) * 1e-2 for _ in range(5)]
    ours, real = nn.Parameter(p0.clone()), nn.Parameter(p0.clone().cuda())
    o1, o2 = Adam8bit([ours], lr=1e-3), bnb.optim.Adam8bit([real], lr=1e-3)
    for grad in grads:
        ours.grad, real.grad = grad.clone(), grad.clone().cuda()
        o1.step()
        o2.step()
    torch.testing.assert_close(ours.detach(), real.detach().cpu(), rtol=1e-4, atol=1e-6)
    s = o2.state[real]
    m, v = o1.moments(ours)
    torch.testing.assert_close(m, F.dequantize_blockwise(s["state1"], s["absmax1"], s["qmap1"], 256).cpu(),
                               rtol=1e-2, atol=1e-8)
    torch.testing.assert_close(v, F.dequantize_blockwise(s["state2"], s["absmax2"], s["qmap2"], 256).cpu(),
                               rtol=1e-2, atol=1e-10)


@needs_cuda
@pytest.mark.parametrize("mode", ["nf4", "nf4-dq", "fp4-dq", "int8"])
def test_real_layers_on_cuda_match_the_emulation(mode):
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    x = torch.randn(8, 64)
    emulated, _ = quantize_model(model, mode)
    real, report = quantize_model(model.cuda(), mode)
    assert report.real and any(type(m).__module__.startswith("bitsandbytes") for m in real.modules())
    torch.testing.assert_close(real(x.cuda()).float().cpu(), emulated(x).float(), rtol=5e-2, atol=5e-2)
