"""The Transformer Engine path, against a stand-in `transformer_engine` package (no GPU here)."""

from __future__ import annotations

import contextlib
import enum
import sys
import types
import warnings
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from ampnb.fp8 import DelayedScaling
from ampnb.fp8.te import convert_to_te, to_te_recipe


class FakeTeLinear(nn.Linear):
    pass


class FakeTeLayerNorm(nn.LayerNorm):
    pass


@pytest.fixture
def fake_te(monkeypatch):
    """Just the names ampnb uses, shaped like Transformer Engine's."""
    root = types.ModuleType("transformer_engine")
    pt = types.ModuleType("transformer_engine.pytorch")
    common = types.ModuleType("transformer_engine.common")
    recipe = types.ModuleType("transformer_engine.common.recipe")
    FakeTeLinear.__module__ = FakeTeLayerNorm.__module__ = "transformer_engine.pytorch.module"
    pt.Linear, pt.LayerNorm = FakeTeLinear, FakeTeLayerNorm

    class Format(enum.Enum):
        E4M3, HYBRID = "E4M3", "HYBRID"

    @dataclass
    class Delayed:
        fp8_format: Format
        amax_history_len: int
        amax_compute_algo: str
        margin: int

    recipe.Format, recipe.DelayedScaling = Format, Delayed
    pt.calls = []

    @contextlib.contextmanager
    def fp8_autocast(enabled, fp8_recipe):
        pt.calls.append((enabled, fp8_recipe, torch.get_default_dtype()))
        yield

    pt.fp8_autocast = fp8_autocast
    root.pytorch, root.common, common.recipe = pt, common, recipe
    for name, mod in (("transformer_engine", root), ("transformer_engine.pytorch", pt),
                      ("transformer_engine.common", common),
                      ("transformer_engine.common.recipe", recipe)):
        monkeypatch.setitem(sys.modules, name, mod)
    return recipe, pt


def test_recipe_fields_map_one_to_one(fake_te):
    fake_te, _ = fake_te
    r = to_te_recipe(DelayedScaling(fp8_format="E4M3", amax_history_len=16,
                                    amax_compute_algo="most_recent", margin=2))
    assert r == fake_te.DelayedScaling(fake_te.Format.E4M3, 16, "most_recent", 2)


def test_dynamic_scaling_needs_a_newer_transformer_engine(fake_te):
    with pytest.raises(ValueError, match="Transformer Engine >= 2.2"):
        to_te_recipe("tensorwise")


def test_layers_are_swapped_like_lightning_with_a_warning_for_unaligned_ones(fake_te):
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.Sequential(nn.Linear(32, 5)))
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(UserWarning, match=r"'0' \(out_features 5 is not a multiple of 16\)"):
        convert_to_te(model)
    assert type(model[0]) is FakeTeLayerNorm and type(model[1]) is FakeTeLinear
    assert type(model[2][0]) is nn.Linear
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), weights, strict=True))
    assert convert_to_te(model) is model  # already TE: left alone, as Lightning does


def test_forward_context_is_lightnings_stack_and_restores_state(fake_te):
    from ampnb.fp8.te import te_forward_context
    from ampnb.putback_state import torch_state as snapshot

    recipe, pt = fake_te
    before = snapshot()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CUDA autocast on a machine without CUDA warns
        with pytest.raises(RuntimeError, match="boom"), te_forward_context(None, torch.float16):
            raise RuntimeError("boom")
    assert snapshot() == before
    (enabled, r, dtype), = pt.calls
    assert enabled and dtype == torch.float16
    assert r == recipe.DelayedScaling(recipe.Format.HYBRID, 1024, "max", 0)


def test_the_mode_takes_the_real_path_where_transformer_engine_runs(fake_te, monkeypatch):
    from ampnb import get_mode
    from ampnb.fp8 import te

    recipe, pt = fake_te
    monkeypatch.setattr(te, "te_status", lambda device="cuda": te.TeStatus(True, "TE on a fake GPU"))
    mode = get_mode("transformer-engine")
    assert mode.availability("cpu").reason == "real (TE on a fake GPU)"
    model = mode.convert_module(nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32)))
    assert [type(m) for m in model] == [FakeTeLinear, FakeTeLayerNorm]
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with mode.forward_context("cpu"):
            pass
    assert pt.calls[-1][2] == torch.bfloat16


def test_convert_to_fp8_auto_takes_transformer_engine_where_it_runs(fake_te, monkeypatch):
    from ampnb.fp8 import backends, convert_to_fp8

    monkeypatch.setattr(backends, "te_status",
                        lambda device="cuda": backends.TeStatus(True, "TE on a fake GPU"))
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 5))
    with pytest.warns(UserWarning, match="out_features 5 is not a multiple of 16") as seen:
        f, report = convert_to_fp8(model, compile=False)
    assert len(seen) == 1  # one warning, the report's: not TE's as well
    assert type(f[0]) is FakeTeLinear and type(f[2]) is nn.Linear and type(model[0]) is nn.Linear
    assert report.backend.name == "te" and report.converted == ("0",)
    first = repr(report).splitlines()[0]
    assert first.startswith("FP8 backend: Transformer Engine, recipe set by fp8_autocast") and \
        ": auto: " in first
