"""Bad input gives one-line ValueErrors and changes nothing; torch state survives user errors."""

from __future__ import annotations

import copy

import pytest
import torch
from test_scaler import make

from ampnb import _state
from ampnb.scaler import ScalerStepper


def _other_optimizer(model):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)


BAD = {
    "accumulation_steps=0": (dict(accumulation_steps=0), "accumulation_steps=0"),
    "accumulation_steps=1.5": (dict(accumulation_steps=1.5), "accumulation_steps=1.5"),
    "clip_norm<0": (dict(clip_norm=-1.0), "clip_norm=-1.0"),
    "growth_factor=1": (dict(growth_factor=1.0), "growth_factor=1.0"),
    "growth_factor<1": (dict(growth_factor=0.5), "growth_factor=0.5"),
    "backoff_factor=1": (dict(backoff_factor=1.0), "backoff_factor=1.0"),
    "backoff_factor=0": (dict(backoff_factor=0.0), "backoff_factor=0.0"),
    "init_scale<=0": (dict(init_scale=0.0), "init_scale=0.0"),
    "init_scale=inf": (dict(init_scale=float("inf")), "init_scale=inf"),
    "growth_interval=0": (dict(growth_interval=0), "growth_interval=0"),
    "enabled with bf16-mixed": (dict(mode="bf16-mixed", enabled=True), "bf16-mixed"),
    "enabled with 32-true": (dict(mode="32-true", enabled=True), "32-true"),
    "enabled not a bool": (dict(enabled="yes"), "enabled='yes'"),
    "foreign optimizer": (dict(optimizer=_other_optimizer), "none of them the model's"),
    "no batches": (dict(batches=[]), "batches is empty"),
    "device mismatch": (dict(device="meta"), "device='meta'"),
    "not a device": (dict(device="gpu0"), "device='gpu0'"),
    "batches not pairs": (dict(batches=[torch.zeros(4, 8)]), "batches[0] is a Tensor"),
    "batches not iterable": (dict(batches=3), "batches=int"),
    "empty generator": (dict(batches=iter([])), "batches is empty"),
    "enabled with fp8": (dict(mode="transformer-engine", enabled=True), "transformer-engine"),
    "unknown mode": (dict(mode="fp17"), "'fp17'"),
}
if not torch.cuda.is_available():
    BAD["cuda on a machine without it"] = (dict(device="cuda"), "needs CUDA")


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_one_line_value_error_and_changes_nothing(name):
    kwargs, fragment = BAD[name]
    kwargs = dict(kwargs)
    model, opt, loss_fn, batches = make(opt="sgd")
    if "optimizer" in kwargs:
        opt = kwargs.pop("optimizer")(model)
    batches = kwargs.pop("batches", batches)
    params = copy.deepcopy(model.state_dict())
    opt_state = copy.deepcopy(opt.state_dict())
    before = _state.snapshot()
    with pytest.raises(ValueError) as err:
        ScalerStepper(model, opt, loss_fn, batches, **kwargs)
    message = str(err.value)
    assert fragment in message and "\n" not in message
    assert _state.snapshot() == before
    assert all(torch.equal(params[k], v) for k, v in model.state_dict().items())
    assert opt.state_dict() == opt_state
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_torch_state_restored_when_user_loss_raises():
    model, opt, _, batches = make()

    def broken_loss(outputs, targets):
        assert torch.is_autocast_enabled("cpu")  # we really were inside autocast
        raise RuntimeError("user bug")

    stepper = ScalerStepper(model, opt, broken_loss, batches)
    before = _state.snapshot()
    with pytest.raises(RuntimeError, match="user bug"):
        stepper.next_stage()
    assert _state.snapshot() == before
    assert stepper.next_stage_name == "forward"  # the failed stage did not advance


def test_torch_state_and_hooks_restored_after_steps():
    model, opt, loss_fn, batches = make()
    before = _state.snapshot()
    stepper = ScalerStepper(model, opt, loss_fn, batches, clip_norm=1.0)
    stepper.inject("inf")
    stepper.run(2)
    assert _state.snapshot() == before
    assert not opt._optimizer_step_post_hooks  # our observer hook was removed


def test_run_rejects_negative_counts():
    model, opt, loss_fn, batches = make()
    stepper = ScalerStepper(model, opt, loss_fn, batches)
    with pytest.raises(ValueError, match="n=-1"):
        stepper.run(-1)
    with pytest.raises(ValueError, match="'mode'"):
        stepper.reset(mode="bf16-mixed")


def test_load_state_dict_refuses_another_mode_and_changes_nothing():
    model, opt, loss_fn, batches = make()
    saved = ScalerStepper(model, opt, loss_fn, batches).state_dict()
    model2, opt2, _, _ = make(seed=3)
    other = ScalerStepper(model2, opt2, loss_fn, batches, mode="bf16-mixed")
    params = copy.deepcopy(model2.state_dict())
    with pytest.raises(ValueError, match="mode '16-mixed', scaler enabled=True") as err:
        other.load_state_dict(saved)
    assert "\n" not in str(err.value)
    assert all(torch.equal(params[k], v) for k, v in model2.state_dict().items())
    with pytest.raises(ValueError, match="missing"):
        other.load_state_dict({"model": params})
