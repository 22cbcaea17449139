"""ScalerPanel: clicking the buttons drives the stepper and the status, listing and plot follow."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from test_scaler import make

from ampnb import putback_state
from ampnb.panels import ScalerPanel
from ampnb.scaler import ScalerStepper


@pytest.fixture
def panel():
    model, opt, loss_fn, batches = make()
    stepper = ScalerStepper(model, opt, loss_fn, batches, init_scale=2.0**8, growth_interval=2)
    return ScalerPanel(stepper, run_n=4)


def _highlighted(panel) -> str:
    return re.search(r'<span style="background[^"]*">(.*?)</span>', panel.listing.value).group(1)


def _plotted_scales(panel) -> list[float]:
    lines = panel.ax.get_lines()
    return list(lines[0].get_ydata()) if lines else []


def test_buttons_are_there_with_stable_names(panel):
    assert set(panel.buttons) == {"Next stage", "Next step", "Run N", "Inject inf",
                                  "Inject NaN", "Reset"}
    assert all(b.description == name for name, b in panel.buttons.items())


def test_next_stage_moves_the_highlight_and_status(panel):
    assert "with torch.autocast" in _highlighted(panel)
    panel.buttons["Next stage"].click()
    assert "loss / 1" in _highlighted(panel)
    assert "next: divide" in panel.status.value
    panel.buttons["Next stage"].click()
    panel.buttons["Next stage"].click()
    assert "scaler.unscale_" in _highlighted(panel)
    assert f"scale {2.0**8:g}" in panel.status.value


def test_next_step_and_run_n_update_status_and_plot(panel):
    draws = panel.draws
    panel.buttons["Next step"].click()
    assert len(panel.stepper.history) == 1 and panel.draws == draws + 1
    panel.buttons["Run N"].click()
    history = panel.stepper.history
    assert len(history) == 1 + panel.n.value
    # The staircase shows each step's scale and the scale the last update left.
    assert _plotted_scales(panel) == [r.scale for r in history] + [history[-1].new_scale]
    assert f"growth tracker {history[-1].growth_tracker}" in panel.status.value


def test_inject_nan_shows_found_inf_skip_and_backoff(panel):
    panel.buttons["Next step"].click()
    scale = panel.stepper.scale
    panel.layer.value = "2"
    panel.buttons["Inject NaN"].click()
    assert "nan in 2" in panel.status.value
    panel.buttons["Next step"].click()
    last = panel.stepper.history[-1]
    assert last.skipped and last.injected == "nan in 2"
    assert "found_inf True" in panel.status.value and "skipped True" in panel.status.value
    assert last.new_scale == scale * panel.stepper.settings.backoff_factor
    panel.buttons["Inject inf"].click()
    panel.buttons["Next step"].click()
    assert panel.stepper.history[-1].injected == "inf in 2"


def test_controls_rebuild_and_bad_values_are_shown(panel):
    before = putback_state.torch_state()
    panel.buttons["Run N"].click()
    panel.controls["init_scale"].value = 2.0**4
    assert panel.stepper.history == [] and panel.stepper.scale == 2.0**4
    assert "2^4" in panel.status.value
    panel.controls["backoff_factor"].value = 1.5
    assert "backoff_factor=1.5" in panel.message.value
    assert panel.stepper.settings.backoff_factor == 0.5  # refused: nothing changed
    panel.controls["backoff_factor"].value = 0.25
    assert panel.message.value == "" and panel.stepper.settings.backoff_factor == 0.25
    panel.controls["accumulation_steps"].value = 3
    assert "range(3)" in panel.listing.value
    panel.controls["clip_norm"].value = 0.5
    assert panel.stepper.settings.clip_norm == 0.5
    assert putback_state.torch_state() == before


def test_reset_returns_to_the_start(panel):
    panel.buttons["Run N"].click()
    panel.buttons["Reset"].click()
    assert panel.stepper.history == [] and "step 0, next: forward" in panel.status.value
    assert _plotted_scales(panel) == []
    assert [t.get_text() for t in panel.ax.texts] == ["no steps yet"]


def test_errors_in_callbacks_are_shown(panel):
    def broken(outputs, targets):
        raise RuntimeError("unscale_() has already been called on this optimizer")

    panel.stepper.loss_fn = broken
    panel.buttons["Next stage"].click()
    assert "RuntimeError" in panel.message.value
    assert "in plain words" in panel.message.value  # torch's message matched a guidance case


def test_guidance_says_why_bf16_needs_no_scaler_and_spots_a_collapse():
    model, opt, loss_fn, batches = make()
    bf16 = ScalerPanel(ScalerStepper(model, opt, loss_fn, batches, mode="bf16-mixed"))
    assert "bf16-mixed needs no GradScaler" in bf16.guidance.value
    assert "scaler disabled (bf16-mixed)" in bf16.status.value
    model, opt, loss_fn, batches = make(huge=(0, 1, 2, 3, 4))  # every batch overflows fp16
    p = ScalerPanel(ScalerStepper(model, opt, loss_fn, batches, init_scale=4.0), run_n=4)
    assert p.guidance.value == ""
    p.buttons["Run N"].click()
    assert all(r.skipped for r in p.stepper.history) and p.stepper.scale < 1
    assert "the scale collapses towards 0" in p.guidance.value


def test_gradient_view_draws_torchs_own_scaled_gradients(panel):
    panel.view.value = "gradients vs fp16"
    assert [t.get_text() for t in panel.ax.texts] == ["no gradients yet: run a step"]
    draws = panel.draws
    panel.buttons["Next step"].click()
    assert panel.draws == draws + 1
    after = next(p for p in panel.ax.patches if p.get_gid() == "after")
    values, edges, _ = after.get_data()
    # Reference: floor(log2|g|) of the gradients torch's scaled backward really produced.
    scaled = panel.stepper.last_grads["scaled"]
    _, exponent = torch.frexp(scaled[scaled != 0])
    expected = torch.bincount((exponent - 1 - int(edges[0])).long(), minlength=len(values))
    assert np.array_equal(values, expected.numpy())
    assert "2^8" in panel.ax.get_title()
    panel.buttons["Inject inf"].click()
    panel.buttons["Next step"].click()
    assert any("inf/NaN (found_inf)" in t.get_text() for t in panel.ax.texts)
    panel.view.value = "scale history"
    assert _plotted_scales(panel)[-1] == panel.stepper.history[-1].new_scale


@pytest.mark.parametrize("bad", ["workbench", "run_n"])
def test_bad_arguments_are_one_line_value_errors(bad):
    from _workbench_kit import make as make_wb

    from ampnb.workbench import Workbench

    model, opt, loss_fn, batches = make()
    stepper = ScalerStepper(model, opt, loss_fn, batches)
    args = ({"stepper": Workbench(*make_wb())} if bad == "workbench" else
            {"stepper": stepper, "run_n": 0})
    with pytest.raises(ValueError, match="is not allowed; allowed"):
        ScalerPanel(**args)


def test_warnings_of_an_action_are_shown_in_the_panel(panel):
    import warnings

    def noisy():
        warnings.warn("a warning from the loop", UserWarning, stacklevel=1)
        return "did it"

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing may escape the panel
        panel._safely(noisy)
    assert "a warning from the loop" in panel.status.value and "did it" in panel.status.value
    assert 'class="ampnb-error ampnb-scaler-error"' not in panel.message.value
