"""Bad input gives one-line ValueErrors and changes nothing; torch state survives user errors."""

from __future__ import annotations

import copy
import dataclasses
import os
import signal
import sys

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from test_scaler import make

import ampnb.scaler
from ampnb import _interrupt, putback_state
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
    "batches not pairs": (dict(batches=[torch.zeros(4, 8)]), "batches[0]: with a loss_fn, a batch is"),
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
    before = putback_state.torch_state()
    with pytest.raises(ValueError) as err:
        ScalerStepper(model, opt, loss_fn, batches, **kwargs)
    message = str(err.value)
    assert fragment in message and "\n" not in message
    assert putback_state.torch_state() == before
    assert all(torch.equal(params[k], v) for k, v in model.state_dict().items())
    assert opt.state_dict() == opt_state
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_torch_state_restored_when_user_loss_raises():
    model, opt, _, batches = make()

    def broken_loss(outputs, targets):
        assert torch.is_autocast_enabled("cpu")  # we really were inside autocast
        raise RuntimeError("user bug")

    stepper = ScalerStepper(model, opt, broken_loss, batches)
    before = putback_state.torch_state()
    with pytest.raises(RuntimeError, match="user bug"):
        stepper.next_stage()
    assert putback_state.torch_state() == before
    assert stepper.next_stage_name == "forward"  # the failed stage did not advance


def test_torch_state_and_hooks_restored_after_steps():
    model, opt, loss_fn, batches = make()
    before = putback_state.torch_state()
    stepper = ScalerStepper(model, opt, loss_fn, batches, clip_norm=1.0)
    stepper.inject("inf")
    stepper.run(2)
    assert putback_state.torch_state() == before
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


@dataclasses.dataclass
class Out:
    """A model output that carries its own loss (as transformers' ModelOutput does)."""

    loss: torch.Tensor
    logits: torch.Tensor


class OwnLoss(torch.nn.Module):
    """make()'s MLP computing its own MSE loss: keyword Out, or a scalar when called positionally."""

    def __init__(self, net, scalar=False):
        super().__init__()
        self.net, self.scalar = net, scalar

    def forward(self, x, y):
        logits = self.net(x)
        loss = F.mse_loss(logits, y)
        return loss if self.scalar else Out(loss, logits)


FORMS = {  # name -> (wrap the batch, wrap the model, the loss line the listing shows)
    "keyword dict, model's own .loss": (lambda x, y: {"x": x, "y": y}, OwnLoss,
                                        "loss = model(**batch).loss"),
    "positional, model returns a scalar": (lambda x, y: (x, y),
                                           lambda net: OwnLoss(net, scalar=True),
                                           "loss = model(*batch)"),
}


@pytest.mark.parametrize("form", list(FORMS))
def test_batches_in_every_form_match_the_inputs_targets_loop(form):
    wrap_batch, wrap_model, line = FORMS[form]
    ref_model, ref_opt, _, batches = make()
    # Without a loss_fn the targets are inputs too; 16-mixed passes inputs as given (the recipe).
    ref = ScalerStepper(ref_model, ref_opt, F.mse_loss, batches,
                        accumulation_steps=2, clip_norm=0.05)
    net, opt, _, batches = make()
    stepper = ScalerStepper(wrap_model(net), opt, None, [wrap_batch(x, y) for x, y in batches],
                            accumulation_steps=2, clip_norm=0.05)
    ref.run(3)
    stepper.run(3)
    assert [r.new_scale for r in stepper.history] == [r.new_scale for r in ref.history]
    assert [r.losses for r in stepper.history] == [r.losses for r in ref.history]
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), ref_model.parameters()))
    assert line in [text.strip() for stage, text in stepper.listing() if stage == "forward"]
    assert "loss = loss_fn(model(x), y)" in [t.strip() for _, t in ref.listing()]


def test_a_model_without_a_loss_and_no_loss_fn_fails_cleanly_and_changes_nothing():
    model, opt, _, batches = make()
    stepper = ScalerStepper(model, opt, None, [x for x, _ in batches])  # positional inputs
    before = putback_state.torch_state()
    with pytest.raises(ValueError, match="without a loss; allowed: pass loss_fn=") as err:
        stepper.next_stage()
    assert "\n" not in str(err.value) and putback_state.torch_state() == before
    assert stepper.next_stage_name == "forward" and stepper.batch_index == 0
    assert not stepper.stages


def test_an_optimizer_class_instead_of_an_instance_is_refused():
    model, _, loss_fn, batches = make()
    with pytest.raises(ValueError, match="optimizer=.*AdamW.*allowed: an optimizer instance"):
        ScalerStepper(model, torch.optim.AdamW, loss_fn, batches)


# ----- interrupts: a KeyboardInterrupt at any line the stepper runs leaves it consistent -----

_SCALER_DIR = os.path.dirname(ampnb.scaler.__file__) + os.sep


def _step_interrupted_at(stepper, k):
    """One step() with a KeyboardInterrupt at the k-th line run in ampnb/scaler (held if deferred).

    Returns (lines run, whether KeyboardInterrupt came out).
    """
    count = [0]

    def local(frame, event, arg):
        if event == "line":
            count[0] += 1
            if count[0] == k:
                if signal.getsignal(signal.SIGINT) is _interrupt._hold:
                    _interrupt._hold(signal.SIGINT, frame)  # as a real SIGINT would be held
                else:
                    raise KeyboardInterrupt
        return local

    def calls(frame, event, arg):
        return local if frame.f_code.co_filename.startswith(_SCALER_DIR) else None

    sys.settrace(calls)
    try:
        stepper.step()
    except KeyboardInterrupt:
        return count[0], True
    finally:
        sys.settrace(None)
    return count[0], False


class Affine(torch.nn.Module):
    """x * w + b: elementwise, so fp16 autocast leaves it in fp32 (CPU fp16 matmuls are slow)."""

    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(-1.0, 1.0, n))
        self.bias = torch.nn.Parameter(torch.full((n,), 0.1))

    def forward(self, x):
        return x * self.weight + self.bias


def _interrupt_case():
    """A 16-mixed stepper after one step, armed with an inf for the next (swept) step."""
    model = torch.nn.Sequential(Affine(8), torch.nn.Tanh(), Affine(8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen))
               for _ in range(3)]
    stepper = ScalerStepper(model, opt, torch.nn.functional.mse_loss, batches,
                            accumulation_steps=2, clip_norm=0.05, init_scale=2.0**10,
                            growth_interval=1)
    stepper.step()
    stepper.inject("inf", layer="2")  # the swept step finds inf, skips and backs off
    return model, opt, stepper


def test_an_interrupt_at_any_line_of_a_step_leaves_the_stepper_consistent():
    ref_model, _, ref = _interrupt_case()
    lines, interrupted = _step_interrupted_at(ref, 0)
    assert not interrupted and lines > 100
    ref.run(1)
    before = putback_state.torch_state()
    for k in range(1, lines + 1):
        model, opt, stepper = _interrupt_case()
        done = len(stepper.stages)
        _, interrupted = _step_interrupted_at(stepper, k)
        assert interrupted, k
        assert putback_state.torch_state() == before, k
        assert not opt._optimizer_step_post_hooks, k
        # Every stage that ran is recorded, in the plan's order, and the cursor agrees.
        ran = [s.stage for s in list(stepper.stages)[done:]]
        plan = [s.name for s in stepper._plan]
        assert ran == (plan * 2)[:len(ran)], k
        assert stepper._cursor == len(ran) % len(plan), k
        past_update = stepper._cursor > plan.index("update")  # history grows in update()
        assert len(stepper.history) == stepper.step_index + past_update, k
        while len(stepper.history) < len(ref.history):  # go on: the same run as without it
            stepper.next_stage()
        assert repr(stepper.history) == repr(ref.history), k  # NaN norms: compare as text
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters())), k


def test_apex_o2_is_refused_with_where_it_runs_and_nothing_is_touched():
    from ampnb.models import demo

    model, opt, loss_fn, batches = demo("mlp")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="'apex-O2' steps fp32 master weights.*Workbench") as info:
        ScalerStepper(model, opt, loss_fn, batches, mode="apex-O2")
    assert "\n" not in str(info.value)
    assert all(v.dtype == before[k].dtype and torch.equal(v, before[k])
               for k, v in model.state_dict().items())
