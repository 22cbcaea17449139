"""Layers as real models write them (#34): Linear subclasses, in-place writes, weights read directly."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ampnb.fp8 import Fp8Linear, convert_to_fp8, fp8_autocast
from ampnb.lowbit import quantize_model


class FalconLinear(nn.Linear):
    """transformers' FalconLinear, as written there: x @ W.T, then + b (its own forward)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        hidden_states = input @ self.weight.T
        if self.bias is None:
            return hidden_states
        return hidden_states + self.bias


FalconLinear.__module__ = "transformers.models.falcon.modeling_falcon"  # where it lives


class LoraLinear(nn.Linear):
    """A subclass whose own forward adds something: swapping it would lose the addition."""

    def __init__(self, n: int) -> None:
        super().__init__(n, n)
        self.extra = nn.Parameter(torch.zeros(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.extra


class PlainSubclass(nn.Linear):
    """A subclass that keeps nn.Linear's forward: converted as nn.Linear is."""


def test_falcon_linear_is_converted_and_its_own_forward_kept_outside_fp8():
    torch.manual_seed(0)
    model = nn.Sequential(FalconLinear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    f, report = convert_to_fp8(model, enabled=None)
    assert isinstance(f[0], Fp8Linear) and report.converted == ("0", "2")
    assert "FalconLinear" not in repr(report)  # not 'left out (not Linear or Conv1D)'
    x = torch.randn(4, 32)
    # Outside fp8_autocast the layer computes exactly what FalconLinear's own forward does.
    assert torch.equal(f(x), model(x))
    with fp8_autocast():
        assert not torch.equal(f(x), model(x))


def test_subclass_with_another_forward_is_left_out_with_a_reason_naming_it():
    model = nn.Sequential(LoraLinear(32), nn.ReLU(), PlainSubclass(32, 32))
    with pytest.warns(UserWarning, match="LoraLinear has its own forward"):
        f, report = convert_to_fp8(model)
    assert report.converted == ("2",)
    (skipped,) = report.skipped
    assert skipped.name == "0" and skipped.kind == "Linear"
    assert "LoraLinear has its own forward" in skipped.reason
    assert "LoraLinear" not in dict(report.left_out)  # it is listed as a layer, with its reason
    assert isinstance(f[0], LoraLinear) and isinstance(f[2], Fp8Linear)


def test_conv1d_subclass_with_its_own_forward_is_left_out():
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils")

    class Scaled(pytorch_utils.Conv1D):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    model = nn.Sequential(Scaled(32, 32), pytorch_utils.Conv1D(32, 32))
    with pytest.warns(UserWarning, match="Scaled has its own forward"):
        f, report = convert_to_fp8(model)
    assert report.converted == ("1",) and isinstance(f[0], Scaled)


class SpecAugment(nn.Module):
    """wav2vec2's SpecAugment: frames of a Linear's output overwritten in place."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)
        self.out = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        h[mask] = 0.0
        return self.out(h)


@pytest.mark.parametrize("shape", [(6, 32), (2, 3, 32)])
def test_in_place_write_into_an_fp8_output_works_as_after_nn_linear(shape):
    torch.manual_seed(0)
    model = SpecAugment()
    f, _ = convert_to_fp8(model)
    x = torch.randn(shape, requires_grad=True)
    mask = torch.zeros(shape[:-1], dtype=torch.bool)
    mask.view(-1)[::2] = True
    for m in (model, f):
        x.grad = None
        m(x, mask).square().sum().backward()
        # The masked frames pass no gradient back, as after nn.Linear.
        assert x.grad[mask].abs().sum() == 0 and x.grad[~mask].abs().sum() > 0


class ReadsOnly(nn.Module):
    """Mamba's mixer reads `dt_proj.weight` in its fused path without calling dt_proj."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.dt_proj = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inp(x) @ self.dt_proj.weight.t()


@pytest.mark.parametrize("mode", ["nf4", "int8"])
def test_lowbit_layer_never_called_has_no_output_figure_instead_of_a_key_error(mode):
    torch.manual_seed(0)
    q, report = quantize_model(ReadsOnly(), mode, inputs=torch.randn(4, 16))
    by_name = {e.name: e for e in report.layers}
    assert by_name["inp"].output_sqnr_db is not None
    assert by_name["dt_proj"].output_sqnr_db is None  # not called: no output to compare
    assert "not called on the inputs: dt_proj" in repr(report)
    q(torch.randn(4, 16)).sum().backward()


def test_deepcopy_of_a_converted_falcon_layer_keeps_its_forward():
    layer = FalconLinear(32, 32)
    f, _ = convert_to_fp8(nn.Sequential(layer), enabled=False)
    g = copy.deepcopy(f)
    x = torch.randn(3, 32)
    assert torch.equal(g(x), layer(x))


def test_real_falcon_model_has_every_linear_layer_in_fp8():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                    num_attention_heads=2, new_decoder_architecture=False)
    model = transformers.FalconForCausalLM(cfg).eval()
    assert any(type(m).__name__ == "FalconLinear" for m in model.modules())
    f, report = convert_to_fp8(model)
    assert not any(type(m).__name__ == "FalconLinear" for m in f.modules())
    assert not report.skipped and "FalconLinear" not in repr(report)
    ids = torch.randint(0, 64, (2, 8))
    f(ids, labels=ids).loss.backward()


def test_lowbit_keeps_a_subclass_with_another_forward_and_counts_it_left_out():
    model = nn.Sequential(LoraLinear(32), nn.ReLU(), FalconLinear(32, 32))
    q, report = quantize_model(model, "nf4")
    assert isinstance(q[0], LoraLinear) and type(q[2]).__name__ == "Linear4bit"
    assert [e.name for e in report.layers] == ["2"] and dict(report.left_out) == {"LoraLinear": 1}


def test_real_wav2vec2_with_spec_augment_trains_after_conversion():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Wav2Vec2Config(
        vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, mask_time_prob=0.5,
        mask_time_length=2, do_stable_layer_norm=True, feat_extract_norm="layer")
    model = transformers.Wav2Vec2ForCTC(cfg).train()  # train(): SpecAugment masks frames in place
    f, report = convert_to_fp8(model)
    assert len(report.converted) == len(report.layers) == 8
    f(torch.randn(2, 800)).logits.sum().backward()
    assert f.lm_head.weight.grad is not None
