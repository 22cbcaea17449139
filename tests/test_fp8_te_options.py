"""Lightning's TransformerEnginePrecision options: recipe dict, weights_dtype, LayerNorm, TE models."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ampnb
from ampnb import putback_state
from ampnb.fp8 import DelayedScaling, Fp8Linear, convert_to_fp8, revert_fp8
from ampnb.fp8.layernorm import TeLayerNorm
from ampnb.fp8.recipe import Fp8Format, from_te_recipe
from ampnb.modes import TransformerEnginePrecision

LIGHTNING_RECIPE = {"fp8_format": "HYBRID", "amax_history_len": 16, "amax_compute_algo": "max"}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 16))


def test_a_recipe_dict_is_read_as_lightning_reads_it():
    mode = TransformerEnginePrecision(weights_dtype=torch.bfloat16, recipe=LIGHTNING_RECIPE)
    assert mode.recipe == DelayedScaling(amax_history_len=16, amax_compute_algo="max")
    model = mode.convert_module(_model())
    fp8 = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(fp8) == 2 and all(m.recipe == mode.recipe for m in fp8)
    assert all(m.amax_history.shape[1] == 16 for m in fp8)
    assert mode.name == "transformer-engine" and model[0].weight.dtype == torch.bfloat16
    assert "16 steps" in mode.description
    assert ampnb.TransformerEnginePrecision is TransformerEnginePrecision


def test_e4m3_and_margin_and_te_defaults_carry_over():
    r = from_te_recipe({"fp8_format": "E4M3", "margin": 2, "amax_compute_algo": "most_recent",
                        "reduce_amax": False, "fp8_dpa": False})
    assert r.fp8_format is Fp8Format.E4M3 and r.margin == 2 and r.backward_format.name == "fp8_e4m3"
    assert from_te_recipe(None) == from_te_recipe({}) == DelayedScaling()  # TE's defaults


def test_a_transformer_engine_delayed_scaling_object_is_read_by_its_fields():
    @dataclasses.dataclass
    class DelayedScaling:  # stands in for transformer_engine.common.recipe.DelayedScaling
        margin: int = 1
        fp8_format: Fp8Format = Fp8Format.E4M3  # an enum read by its name, as TE's Format
        amax_history_len: int = 8
        amax_compute_algo: str = "max"
        reduce_amax: bool = True

    r = from_te_recipe(DelayedScaling())
    assert (r.margin, r.fp8_format, r.amax_history_len) == (1, Fp8Format.E4M3, 8)


@pytest.mark.parametrize(("recipe", "match"), [
    ({"fp8_fromat": "HYBRID"}, "no field 'fp8_fromat'; allowed: margin, fp8_format"),
    ({"fp8_format": "E5M2"}, "fp8_format='E5M2' is not allowed; allowed: 'HYBRID', 'E4M3'"),
    ({"fp8_format": "E2M1"}, "fp8_format='E2M1' is not allowed"),
    ({"amax_compute_algo": max}, "callable amax_compute_algo is not emulated"),
    ({"fp8_dpa": True}, "fp8_dpa=True is not emulated by ampnb; allowed: False"),
    ({"amax_history_len": 0}, "amax_history_len=0 is not allowed"),
    ("HYBRID", "recipe='HYBRID' is not allowed"),
])
def test_bad_recipes_name_the_value_and_leave_the_model_alone(recipe, match):
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        TransformerEnginePrecision(weights_dtype=torch.bfloat16, recipe=recipe).convert_module(model)
    assert [type(m) for m in model] == [nn.Linear, nn.LayerNorm, nn.ReLU, nn.Linear]
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"weights_dtype": "bf16"}, "weights_dtype='bf16' is not allowed"),
    ({"weights_dtype": torch.int8}, "weights_dtype=torch.int8 is not allowed"),
    ({"weights_dtype": torch.bfloat16, "fallback_compute_dtype": 16}, "fallback_compute_dtype=16"),
    ({"weights_dtype": torch.bfloat16, "replace_layers": "yes"}, "replace_layers='yes'"),
])
def test_bad_options_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TransformerEnginePrecision(**kwargs)


def test_weights_dtype_and_fallback_compute_dtype():
    mode = TransformerEnginePrecision(weights_dtype=torch.float16,
                                      fallback_compute_dtype=torch.bfloat16)
    assert mode.name == "transformer-engine-float16"
    model = mode.convert_module(_model())
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    before = putback_state.torch_state()
    with mode.forward_context("cpu"):
        assert torch.get_default_dtype() == torch.float16
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert putback_state.torch_state() == before


def test_layernorm_is_replaced_with_te_numerics_and_shares_its_parameters():
    model = _model()
    ln = model[1]
    fp32_ln = copy.deepcopy(ln)
    mode = TransformerEnginePrecision(weights_dtype=torch.bfloat16, recipe=LIGHTNING_RECIPE)
    model = mode.convert_module(model)
    te_ln = model[1]
    assert isinstance(te_ln, TeLayerNorm) and te_ln.weight is ln.weight and te_ln.bias is ln.bias
    x = torch.randn(4, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = te_ln(x)
        plain = fp32_ln(x)  # nn.LayerNorm under autocast runs and returns fp32
    # te.LayerNorm: input and affine cast to the activation dtype, fp32 math, activation dtype out.
    want = F.layer_norm(x.bfloat16().float(), (32,), ln.weight.bfloat16().float(),
                        ln.bias.bfloat16().float(), ln.eps).bfloat16()
    assert got.dtype == torch.bfloat16 and plain.dtype == torch.float32 and torch.equal(got, want)
    x32 = torch.randn(4, 32)
    ln32 = nn.LayerNorm(32)
    assert torch.equal(TeLayerNorm(ln32)(x32), ln32(x32))  # fp32 in, no autocast: the same op
    assert revert_fp8(model)[1] is ln


def test_a_layernorm_without_bias_stays_with_a_warning():
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32, bias=False))
    with pytest.warns(UserWarning, match="LayerNorm.*needs both weight and bias"):
        model = ampnb.get_mode("transformer-engine").convert_module(model)
    assert type(model[1]) is nn.LayerNorm and isinstance(model[0], Fp8Linear)


def test_a_model_with_te_layers_already_is_left_alone():
    model = _model()
    model[0] = convert_to_fp8(model[0])[0]  # the user put one FP8 layer in already
    model = ampnb.get_mode("transformer-engine").convert_module(model)
    assert [type(m) for m in model] == [Fp8Linear, nn.LayerNorm, nn.ReLU, nn.Linear]
    assert model[3].weight.dtype == torch.bfloat16  # still cast to the weights dtype, as Lightning

    class FakeTeLinear(nn.Linear):
        pass

    FakeTeLinear.__module__ = "transformer_engine.pytorch.module.linear"
    model = nn.Sequential(FakeTeLinear(16, 32), nn.Linear(32, 16), nn.LayerNorm(16))
    model = ampnb.get_mode("transformer-engine").convert_module(model)
    assert [type(m) for m in model] == [FakeTeLinear, nn.Linear, nn.LayerNorm]


def test_replace_layers_false_only_casts():
    mode = TransformerEnginePrecision(weights_dtype=torch.bfloat16, replace_layers=False)
    model = mode.convert_module(_model())
    assert [type(m) for m in model] == [nn.Linear, nn.LayerNorm, nn.ReLU, nn.Linear]
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_workbench_trains_with_a_configured_te_precision():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)) for _ in range(2)]
    mode = TransformerEnginePrecision(weights_dtype=torch.bfloat16, recipe=LIGHTNING_RECIPE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every layer fits: no warning
        wb = ampnb.Workbench(model, opt, nn.MSELoss(), batches, mode=mode)
    records = wb.run(2)
    assert all(torch.isfinite(torch.tensor(r.loss)) for r in records)
    fp8 = [m for m in wb.model.modules() if isinstance(m, Fp8Linear)]
    assert fp8 and all(m.recipe.amax_history_len == 16 and m.filled[0] == 2 for m in fp8)
    assert isinstance(wb.model[1], TeLayerNorm)
    with pytest.warns(UserWarning, match="hold bfloat16 values"):
        wb.set(mode="32-true")
    assert type(wb.model[1]) is nn.LayerNorm  # the Workbench puts the plain layers back
