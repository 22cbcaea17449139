"""Precision modes: names, aliases, errors, dtypes against plain torch, state restored."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampnb import get_mode
from ampnb.modes import ALIASES, MODES, cast_floats
from ampnb.putback_state import torch_state as snapshot

LIGHTNING = ["32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "64-true"]
RUNNABLE = LIGHTNING  # FP8 modes are registered but run elsewhere (ampnb.fp8)


def tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


@pytest.mark.parametrize("name", LIGHTNING + ["transformer-engine", "transformer-engine-float16"])
def test_every_lightning_string_is_registered(name):
    assert get_mode(name).name == name
    assert get_mode(name.upper()).name == name


@pytest.mark.parametrize(
    ("alias", "name"),
    [(32, "32-true"), ("32", "32-true"), (64, "64-true"), ("64", "64-true"),
     (16, "16-mixed"), ("16", "16-mixed"), ("bf16", "bf16-mixed")],
)
def test_legacy_aliases_match_lightning(alias, name):
    assert get_mode(alias) is MODES[name]
    assert ALIASES[alias] == name


def test_instance_passes_through():
    mode = MODES["bf16-mixed"]
    assert get_mode(mode) is mode


@pytest.mark.parametrize("bad", ["fp16", "16-bit", 8, True, None, 3.0, "bf16-Mixed-x"])
def test_unknown_mode_names_the_value_and_the_choices(bad):
    with pytest.raises(ValueError) as err:
        get_mode(bad)
    message = str(err.value)
    assert repr(bad) in message and "\n" not in message
    for name in LIGHTNING:
        assert name in message
    assert "'bf16'->bf16-mixed" in message


def test_mode_attributes_follow_fabric():
    assert MODES["16-mixed"].uses_scaler and MODES["16-mixed"].is_mixed
    assert not MODES["bf16-mixed"].uses_scaler and MODES["bf16-mixed"].is_mixed
    for name in ["32-true", "16-true", "bf16-true", "64-true"]:
        assert not MODES[name].uses_scaler and not MODES[name].is_mixed
    assert MODES["transformer-engine"].param_dtype == torch.bfloat16
    assert MODES["transformer-engine-float16"].param_dtype == torch.float16


def reference(name: str, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What a hand-written plain-torch program does for each mode."""
    plain = {
        "32-true": lambda: model(x),
        "16-mixed": lambda: _autocast(model, x, torch.float16),
        "bf16-mixed": lambda: _autocast(model, x, torch.bfloat16),
        "16-true": lambda: model.to(torch.float16)(x.half()),
        "bf16-true": lambda: model.to(torch.bfloat16)(x.bfloat16()),
        "64-true": lambda: model.to(torch.float64)(x.double()),
    }
    return plain[name]()


def _autocast(model, x, dtype):
    with torch.autocast("cpu", dtype=dtype):
        return model(x.to(dtype))


@pytest.mark.parametrize("name", RUNNABLE)
def test_dtypes_and_values_match_plain_torch(name):
    mode = get_mode(name)
    x = torch.randn(3, 8)
    model = mode.convert_module(tiny())
    with mode.forward_context("cpu"):
        out = model(mode.convert_input(x))
    expected = reference(name, tiny(), x)
    assert {p.dtype for p in model.parameters()} == {mode.param_dtype}
    assert out.dtype == expected.dtype == mode.compute_dtype
    assert torch.equal(out, expected)
    assert mode.convert_output(out).dtype == torch.float32


@pytest.mark.parametrize("name", ["16-true", "bf16-true", "64-true"])
def test_true_modes_create_tensors_and_modules_in_their_dtype(name):
    mode = get_mode(name)
    with mode.module_init_context():
        layer = nn.Linear(4, 4)
        fresh = torch.zeros(2)
    assert layer.weight.dtype == fresh.dtype == mode.param_dtype
    with mode.forward_context():
        assert torch.ones(1).dtype == mode.param_dtype
    assert torch.get_default_dtype() == torch.float32


def test_convert_input_casts_only_floats_in_nested_data():
    data = {"x": torch.randn(2), "ids": torch.arange(3), "pair": (torch.ones(1), 5)}
    out = get_mode("bf16-true").convert_input(data)
    assert out["x"].dtype == torch.bfloat16 and out["pair"][0].dtype == torch.bfloat16
    assert out["ids"].dtype == torch.int64 and out["pair"][1] == 5
    assert get_mode("32-true").convert_input(data) is data
    assert cast_floats([torch.ones(1)], torch.float64)[0].dtype == torch.float64


@pytest.mark.parametrize("name", RUNNABLE)
@pytest.mark.parametrize("context", ["forward_context", "module_init_context"])
def test_state_restored_when_the_body_raises(name, context):
    before = snapshot()
    mode = get_mode(name)
    ctx = getattr(mode, context)("cpu") if context == "forward_context" else mode.module_init_context()
    with pytest.raises(RuntimeError, match="boom"), ctx:
        raise RuntimeError("boom")
    assert snapshot() == before


def test_scaler_only_for_16_mixed():
    scaler = get_mode("16-mixed").make_scaler("cpu")
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.get_scale() == 2.0**16
    for name in ["32-true", "bf16-mixed", "16-true", "bf16-true", "64-true"]:
        assert get_mode(name).make_scaler("cpu") is None


@pytest.mark.parametrize("name", RUNNABLE)
def test_runnable_on_cpu(name):
    assert get_mode(name).availability("cpu").ok
    get_mode(name).check("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a CUDA-less machine")
def test_cuda_without_cuda_says_what_runs_instead():
    found = get_mode("bf16-mixed").availability("cuda")
    assert not found and "CUDA" in found.reason and found.fallback == "cpu"
    with pytest.raises(ValueError, match=r"bf16-mixed on 'cuda' needs CUDA.*use 'cpu' instead"):
        get_mode("bf16-mixed").check("cuda")


def test_html_names_dtypes():
    html = get_mode("bf16-mixed")._repr_html_()
    assert "bfloat16" in html and "float32" in html
