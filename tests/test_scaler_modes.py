"""bf16-mixed runs with the scaler disabled; 16-true explains unscaling fp16 gradients."""

from __future__ import annotations

import pytest
import torch
from test_scaler import make, plain_loop

from ampnb import get_mode
from ampnb.scaler import ScalerStepper, diagnose


def test_bf16_mixed_disables_the_scaler_and_matches_plain_bf16_loop():
    ref_model, ref_opt, loss_fn, batches = make()
    ref = plain_loop(ref_model, ref_opt, loss_fn, batches, 3, accum=2, dtype=torch.bfloat16,
                     scaler_on=False)
    model, opt, loss_fn, batches = make()
    stepper = ScalerStepper(model, opt, loss_fn, batches, mode="bf16-mixed", accumulation_steps=2)
    assert stepper.enabled is False and not stepper.scaler.is_enabled()
    history = stepper.run(3)
    assert all(r.scale == 1.0 and not r.skipped for r in history)
    assert [r.losses for r in history] == ref.losses
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))
    assert [g.case for g in diagnose(stepper)] == ["bf16_no_scaler"]


def test_bf16_mixed_without_scaler_does_not_skip_nan():
    model, opt, loss_fn, batches = make()
    stepper = ScalerStepper(model, opt, loss_fn, batches, mode="bf16-mixed")
    stepper.inject("nan")
    record = stepper.step()
    # No scaler stands guard: found by looking, and the step is applied anyway.
    assert record.found_inf and not record.skipped
    assert all(torch.isnan(p).all() for p in model.parameters())


def test_16_true_runs_without_scaler_and_explains_fp16_gradients():
    mode = get_mode("16-true")
    model, opt, loss_fn, batches = make(opt="sgd")
    stepper = ScalerStepper(model, opt, loss_fn, batches, mode=mode)
    assert stepper.enabled is False
    assert all(p.dtype == mode.param_dtype for p in model.parameters())
    stepper.run(1)
    guidance = diagnose(stepper)
    assert [g.case for g in guidance] == ["fp16_grads"]
    assert "Attempting to unscale FP16 gradients" in guidance[0].torch_says


def test_torch_a_disabled_grad_scaler_step_is_a_plain_optimizer_step():
    model, opt, loss_fn, batches = make()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    ran = []
    opt.register_step_post_hook(lambda *_: ran.append(True))
    x, y = batches[0]
    loss = loss_fn(model(x), y)
    assert scaler.scale(loss) is loss  # scale() hands the loss back as it is
    loss.backward()
    for p in model.parameters():
        p.grad.fill_(float("inf"))
    scaler.step(opt)  # no inf check, no skip: optimizer.step() runs
    assert ran == [True]
    assert not any(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("mode", ["bf16-mixed", "32-true"])
def test_without_a_scaler_the_listing_and_records_say_inf_reaches_the_weights(mode):
    model, opt, loss_fn, batches = make()
    stepper = ScalerStepper(model, opt, loss_fn, batches, mode=mode)
    step_line = next(line for stage, line in stepper.listing() if stage == "step")
    assert "optimizer.step() runs: no inf/NaN check without a GradScaler" in step_line
    assert not any("no-op" in line for _, line in stepper.listing())
    backward_line = next(line for stage, line in stepper.listing() if stage == "backward")
    assert "scale() returns the loss as it is" in backward_line
    clean = stepper.step()
    assert clean.nonfinite_weights == 0
    stepper.inject("inf")
    record = stepper.step()
    bad = sum(int((~torch.isfinite(p)).sum()) for p in model.parameters())
    assert record.found_inf and not record.skipped
    assert record.nonfinite_weights == bad == sum(p.numel() for p in model.parameters())
    note = [s for s in stepper.stages if s.stage == "step"][-1].note
    assert "non-finite gradients reached the weights" in note and f"({bad} values" in note


def test_with_a_scaler_an_injected_inf_never_reaches_the_weights():
    model, opt, loss_fn, batches = make()
    stepper = ScalerStepper(model, opt, loss_fn, batches)
    step_line = next(line for stage, line in stepper.listing() if stage == "step")
    assert "skipped if found_inf" in step_line
    stepper.inject("inf")
    record = stepper.step()
    assert record.skipped and record.nonfinite_weights == 0
