"""The stepper's stages run the one step (ampnb.step): forward and loss under the mode's autocast,
backward with autocast off, every stage inside step_context; runners need only the step's records."""

from __future__ import annotations

import pytest
import torch
from test_scaler import make

import ampnb.scaler.stepper as stepper_module
from ampnb import _kernels, putback_state
from ampnb.fp16_kernels import set_fp16_kernels
from ampnb.precision import Precision
from ampnb.scaler import ScalerStepper
from ampnb.scaler.stages import plan
from ampnb.scaler.state import Parts, StepState
from ampnb.step import StepSettings, step_context


class Probe(torch.nn.Module):
    """Records, in forward and in backward, whether autocast is on and fp16 kernels are overridden."""

    def __init__(self, seen):
        super().__init__()
        self.seen = seen

    def forward(self, x):
        self.seen.append(("forward", torch.is_autocast_enabled("cpu"), bool(_kernels._active)))
        if x.requires_grad:
            x.register_hook(self._backward)
        return x

    def _backward(self, grad):
        self.seen.append(("backward", torch.is_autocast_enabled("cpu"), bool(_kernels._active)))
        return grad


@pytest.fixture
def emulated():
    previous = set_fp16_kernels("emulated")  # fp16 products emulated whatever this CPU has
    yield
    set_fp16_kernels(previous)


@pytest.mark.parametrize("outer_autocast", [False, True])
def test_forward_under_autocast_backward_without_it_both_with_the_fp16_kernels(emulated,
                                                                               outer_autocast):
    seen = []
    model, opt, loss_fn, batches = make()
    model.insert(1, Probe(seen))
    stepper = ScalerStepper(model, opt, loss_fn, batches, accumulation_steps=2)
    before = putback_state.torch_state()
    if outer_autocast:  # a learner's own autocast around the call changes nothing in backward
        with torch.autocast("cpu", dtype=torch.bfloat16):
            stepper.step()
    else:
        stepper.step()
    assert seen == [("forward", True, True), ("backward", False, True)] * 2
    assert putback_state.torch_state() == before and not _kernels._active


def test_run_enters_the_step_context_once_and_a_lone_stage_once(monkeypatch):
    entered = []
    real = stepper_module.step_context

    def counting(settings, models=None):
        entered.append(settings)
        return real(settings, models)

    monkeypatch.setattr(stepper_module, "step_context", counting)
    model, opt, loss_fn, batches = make()
    stepper = ScalerStepper(model, opt, loss_fn, batches, accumulation_steps=2)
    stepper.run(3)
    assert len(entered) == 1
    assert (entered[0].mode, entered[0].device) == (stepper.mode, "cpu")
    stepper.step()
    stepper.next_stage()
    assert len(entered) == 3


def test_the_stage_table_runs_from_the_step_records_alone():
    """Driving STAGES by hand with a Parts and a StepState is the stepper's own run."""
    model, opt, loss_fn, batches = make(seed=3)
    stepper = ScalerStepper(model, opt, loss_fn, batches, accumulation_steps=2, clip_norm=0.05)
    stepper.run(3)
    ref_model, ref_opt, _, _ = make(seed=3)
    ref = ScalerStepper(ref_model, ref_opt, loss_fn, batches, accumulation_steps=2,
                        clip_norm=0.05)  # converts the model and holds the scaler, unused
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    p = Precision.of(ref.mode, device="cpu", scaler=scaler)
    parts = Parts(ref_model, ref_opt, scaler, loss_fn, p, ref.settings, ref._data,
                  list(ref_model.parameters()))
    state, finished = StepState(scale=2.0**16, scale_now=2.0**16), []
    with step_context(StepSettings(p)):
        for _ in range(3):
            for stage in plan(2):
                prepared = None if stage.prepare is None else stage.prepare(parts, state)
                stage.run(parts, state, prepared)
            finished.append(state.finished)
            state = state.next_step(state.scale_now)
    assert repr(finished) == repr(stepper.history)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))


def test_a_batch_on_the_device_is_not_moved_and_a_new_loss_fn_is_used():
    model, opt, loss_fn, batches = make()
    stepper = ScalerStepper(model, opt, loss_fn, batches)
    stepper.run(2)
    placed = stepper._parts.placed
    assert set(placed) == {id(b) for b in batches[:2]} and all(placed.values())
    calls = []

    def counted(output, target):
        calls.append(1)
        return loss_fn(output, target)

    stepper.loss_fn = counted
    stepper.step()
    assert calls == [1] and stepper.loss_fn is counted
