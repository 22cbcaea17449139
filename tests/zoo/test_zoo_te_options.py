"""Lightning's TransformerEnginePrecision options on the zoo's LayerNorm models, via the Workbench."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from zoo_models import BUILDERS

from ampnb.fp8 import Fp8Linear
from ampnb.fp8.layernorm import TeLayerNorm
from ampnb.modes import TransformerEnginePrecision
from ampnb.workbench import Workbench

RECIPE = {"fp8_format": "HYBRID", "amax_history_len": 16, "amax_compute_algo": "max"}


@pytest.mark.parametrize("name", ["gpt2", "bert", "vit"])  # the zoo models with nn.LayerNorm
def test_layernorms_and_linears_are_swapped_and_train(name):
    case = BUILDERS[name]()
    norms = sum(type(m) is nn.LayerNorm for m in case.model.modules())
    keys = set(case.model.state_dict())
    mode = TransformerEnginePrecision(weights_dtype=torch.bfloat16, recipe=RECIPE)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "FP8: .* stay in higher precision")  # unaligned heads
        wb = Workbench(case.model, case.optimizer(), case.loss_fn, [case.batch], mode=mode)
    assert sum(isinstance(m, TeLayerNorm) for m in wb.model.modules()) == norms > 0
    assert not any(type(m) is nn.LayerNorm for m in wb.model.modules())
    assert set(wb.model.state_dict()) == keys  # the swap adds no keys
    record = wb.step()
    assert torch.isfinite(torch.tensor(record.loss))
    assert all(m.recipe.amax_history_len == 16 for m in wb.model.modules() if isinstance(m, Fp8Linear))
    with pytest.warns(UserWarning, match="hold bfloat16 values"):
        wb.set(mode="32-true")
    assert sum(type(m) is nn.LayerNorm for m in wb.model.modules()) == norms

