"""The ScalerPanel on transformers models: its buttons drive the stepper exactly as direct calls do."""

from __future__ import annotations

import pytest
import torch
from zoo_models import BUILDERS

from ampnb import putback_state
from ampnb.panels import ScalerPanel
from ampnb.scaler import ScalerStepper


def _stepper(name: str) -> ScalerStepper:
    case = BUILDERS[name]()
    return ScalerStepper(case.model, case.optimizer(), case.loss_fn, [case.batch],
                         mode="16-mixed", accumulation_steps=2, clip_norm=1.0)


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_clicks_equal_direct_calls_on_a_keyword_batch_model(name):
    before = putback_state.torch_state()
    clicked, direct = _stepper(name), _stepper(name)
    panel = ScalerPanel(clicked, run_n=2)
    layer = panel.layer.options[-1]  # one layer's gradients
    torch.manual_seed(0)  # dropout is on: both runs draw the same masks
    panel.buttons["Next stage"].click()
    panel.buttons["Next step"].click()
    panel.layer.value = layer
    panel.buttons["Inject inf"].click()
    panel.buttons["Run N"].click()
    torch.manual_seed(0)
    direct.next_stage()
    direct.step()
    direct.inject("inf", layer)
    direct.run(2)
    assert "ampnb-error" not in panel.message.value, panel.message.value
    assert [r.skipped for r in clicked.history] == [r.skipped for r in direct.history]
    assert any(r.skipped for r in clicked.history)  # the injected inf: skipped, scale backed off
    assert [r.new_scale for r in clicked.history] == [r.new_scale for r in direct.history]
    assert [r.losses for r in clicked.history] == [r.losses for r in direct.history]
    for a, b in zip(clicked.model.parameters(), direct.model.parameters()):
        assert torch.equal(a, b)
    assert putback_state.torch_state() == before
