"""A mode configured once with its device and scaler (Fabric's MixedPrecision(precision, device,
scaler)): its hooks take neither, and its steps are torch.amp's recipe bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampnb


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 8, generator=g) * 50, torch.randint(0, 2, (4,), generator=g)


def test_a_configured_16_mixed_loop_is_the_torch_amp_recipe_bit_for_bit():
    x, y = _data()
    ref, mine = _model(), _model()
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt_m = torch.optim.AdamW(mine.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20)  # high: the first step skips
    p = ampnb.Precision.of("16-mixed", model=mine, scaler=torch.amp.GradScaler("cpu", init_scale=2.0**20))
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(ref(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt_r)
        scaler.update()
        opt_r.zero_grad()
        with p.forward_context():  # no device, no scaler: the object owns them
            loss = nn.functional.cross_entropy(mine(x), y)
        p.backward(loss)
        p.optimizer_step(opt_m)
        opt_m.zero_grad()
    assert p.scaler.get_scale() == scaler.get_scale()
    for a, b in zip(ref.parameters(), mine.parameters()):
        assert torch.equal(a, b)


def test_the_device_is_the_models_and_the_scaler_the_modes():
    p = ampnb.Precision.of("bf16-mixed", model=_model())
    assert p.device == "cpu" and p.scaler is None and "model's parameters" in p.why
    q = ampnb.Precision.of(16, model=_model())
    assert q.mode.name == "16-mixed" and isinstance(q.scaler, torch.amp.GradScaler)
    with pytest.raises(ValueError, match=r"scaler=GradScaler is not allowed with bf16-mixed"):
        ampnb.Precision.of("bf16-mixed", model=_model(), scaler=torch.amp.GradScaler("cpu"))
    out = ampnb.Precision.of("bf16-mixed", model=_model()).step(_model(), torch.optim.SGD(
        _model().parameters(), lr=0.1), _data(), nn.functional.cross_entropy)
    assert out.loss.dtype == torch.float32 and not out.skipped


@pytest.mark.skipif(torch.cuda.is_available(), reason="simulates CUDA on a CPU machine")
def test_on_a_gpu_machine_a_cpu_model_binds_the_cpu_and_cuda_is_refused(gpu_machine):
    model = _model()
    p = ampnb.Precision.of("bf16-mixed", model=model)
    assert p.device == "cpu"
    with p.forward_context():
        assert model(torch.randn(2, 8)).dtype == torch.bfloat16  # CPU autocast lowered it
    with pytest.raises(ValueError, match=r"device=cuda but the model's parameters are on cpu"):
        ampnb.Precision.of("bf16-mixed", model=model, device="cuda")
