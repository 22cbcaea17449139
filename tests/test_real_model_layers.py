"""Real models read converted layers directly, and headlines count parameters (issue: the doctor at scale)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ampnb.fp8 import convert_to_fp8
from ampnb.lowbit import quantize_model


class ReadsWeight(nn.Module):
    """As Mamba reads `dt_proj.weight`: the layer is called once, its weight read directly once."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.proj = nn.Linear(32, 32)
        self.out = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h + (self.proj.weight @ h.transpose(-1, -2)).transpose(-1, -2)
        h = h + F.linear(h, self.proj.weight)
        return self.out(h)


@pytest.mark.parametrize("mode", ["nf4", "nf4-dq", "int8", "int8-training"])
def test_lowbit_layer_read_directly_runs_forward_and_backward(mode: str):
    torch.manual_seed(0)
    model = ReadsWeight()
    q, _ = quantize_model(model, mode)
    assert q.proj.weight.dtype == torch.float32  # the source weight's dtype
    assert q.proj.weight.shape == model.proj.weight.shape
    x = torch.randn(4, 16, requires_grad=True)
    loss = q(x).square().mean()
    loss.backward()
    assert torch.isfinite(loss) and x.grad is not None and torch.isfinite(x.grad).all()
    assert q.out.bias.grad is not None
    if mode == "int8-training":  # the trainable fp16 weight gets the direct read's gradient too
        assert q.proj.weight16.grad is not None and q.proj.weight16.grad.abs().sum() > 0
    # The values are those the layer computes with, widened exactly.
    torch.testing.assert_close(q.proj.weight, q.proj.linear_weight().float(), rtol=0, atol=0)


def test_lowbit_weight_keeps_a_bf16_source_dtype():
    model = ReadsWeight().to(torch.bfloat16)
    q, _ = quantize_model(model, "nf4")
    assert q.proj.weight.dtype == torch.bfloat16
    q(torch.randn(2, 16, dtype=torch.bfloat16)).float().sum().backward()


def test_fp8_layer_read_directly_runs_forward_and_backward():
    torch.manual_seed(0)
    model = ReadsWeight()
    f, report = convert_to_fp8(model)
    assert f.proj.weight.dtype == torch.float32 and len(report.converted) == 3
    x = torch.randn(4, 16, requires_grad=True)
    f(x).square().mean().backward()
    assert x.grad is not None and f.proj.weight.grad is not None


class Experts(nn.Module):
    """Fused experts as Mixtral holds them: one nn.Parameter, not Linear layers."""

    def __init__(self, n: int = 8, d: int = 32) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(n, d, d) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bd,edf->bf", x, self.w)


class Moe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 32, bias=False)
        self.experts = Experts()
        self.down = nn.Linear(32, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.experts(self.up(x)))


def test_fp8_headline_states_the_share_of_parameters():
    model = Moe()
    _, report = convert_to_fp8(model)
    share = round(100 * 2 * 32 * 32 / (2 * 32 * 32 + 8 * 32 * 32))  # 20 %
    head = report.table().caption
    assert head == f"2 of 2 linear layers in FP8, {share} % of the parameters; left out: 1 Experts"
    assert head in repr(report)
    assert (report.params.converted, report.params.total) == (2 * 32 * 32, 10 * 32 * 32)


def test_lowbit_headline_states_the_share_of_parameters():
    model = Moe()
    _, report = quantize_model(model, "nf4")
    assert "2 Linear layers, 20 % of the parameters, quantized; left out: 1 Experts" in \
        report.table().caption
    again, report_again = quantize_model(_, "int8")
    assert report_again.already and "20 % of the parameters" in report_again.table().caption


def test_headline_unchanged_when_only_embeddings_and_norms_are_left_out():
    model = nn.Sequential(nn.Embedding(10, 32), nn.LayerNorm(32), nn.Linear(32, 32))
    _, report = convert_to_fp8(model)
    assert report.table().caption == "1 of 1 linear layers in FP8"
    assert not report.params.large_left_out and report.params.converted == 32 * 32


def test_mamba_quantized_runs_forward_and_backward():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "MambaForCausalLM"):
        pytest.skip("this transformers has no MambaForCausalLM")
    torch.manual_seed(0)
    cfg = transformers.MambaConfig(vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=1,
                                   expand=2, conv_kernel=4, time_step_rank=8)
    model = transformers.MambaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (2, 8))
    for mode in ("nf4", "int8"):
        q, report = quantize_model(model, mode, ignore_modules={"lm_head"})
        mixer = q.backbone.layers[0].mixer
        assert type(mixer.dt_proj).__name__ in ("Linear4bit", "Linear8bitLt")
        out = q(ids, labels=ids)
        out.loss.backward()
        assert torch.isfinite(out.loss)
        assert "of the parameters" in report.table().caption  # the Conv1d is left out
    with pytest.warns(UserWarning, match="x_proj"):  # 24 outputs: not a multiple of 16
        f, _ = convert_to_fp8(model)
    f(ids, labels=ids).loss.backward()
