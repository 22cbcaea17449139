"""The doctor leaves the user's model, optimizer, RNG and torch's global state as they were."""

from __future__ import annotations

import copy

import pytest
import torch
from doctor_models import Plain, data
from torch import nn

import ampnb
from ampnb.putback_state import torch_state as snapshot

CE = nn.functional.cross_entropy
FAST = dict(repeat=1, profile=False, modes=("32-true", "bf16-mixed", "16-true"))


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = Plain().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = data()
    CE(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _picture(model: nn.Module, opt: torch.optim.Optimizer) -> tuple:
    return (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), model.training,
            [(p.dtype, p.requires_grad, p.grad) for p in model.parameters()],
            torch.get_rng_state(), snapshot())


def _same(a: tuple, b: tuple) -> None:
    assert a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0])
    sa, sb = a[1]["state"], b[1]["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        assert all(torch.equal(torch.as_tensor(sa[k][n]), torch.as_tensor(sb[k][n])) for n in sa[k])
    assert a[2:4] == b[2:4]
    assert torch.equal(a[4], b[4]) and a[5] == b[5]


def test_untouched_after_a_run():
    model, opt = _trained()
    before = _picture(model, opt)
    report = ampnb.doctor(model, data(), CE, optimizer=opt, **FAST)
    _same(before, _picture(model, opt))
    assert report.modes[0].name == "32-true"


class Boom(Exception):
    pass


@pytest.mark.parametrize("error", [Boom, KeyboardInterrupt])
@pytest.mark.parametrize("at_call", [1, 3, 5, 6])
def test_untouched_when_the_loss_raises(error, at_call):
    model, opt = _trained()
    before = _picture(model, opt)
    calls = []

    def loss_fn(out, y):
        calls.append(1)
        if len(calls) == at_call:
            raise error("stop")
        return CE(out, y)

    with pytest.raises(error):
        ampnb.doctor(model, data(), loss_fn, optimizer=opt, **FAST)
    _same(before, _picture(model, opt))


def _with_grads() -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model mid-training: optimizer state, and gradients of the next batch not yet stepped."""
    model, opt = _trained()
    x, y = data()
    CE(model(x) * 3, y).backward()
    return model, opt


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("interrupt_at", [None, 1, 3])
def test_gradients_and_optimizer_state_set_aside_come_back_exactly(interrupt_at):
    """The doctor puts the user's gradients and optimizer state on disk while it works on copies;
    they come back bit for bit, also when an interrupt lands between its stages."""
    model, opt = _with_grads()
    grads, state = _grads(model), copy.deepcopy(opt.state_dict())
    seen = []

    def progress(text):
        seen.append(text)
        if interrupt_at is not None and len(seen) == interrupt_at:
            assert all(p.grad is None for p in model.parameters()) and not opt.state  # aside
            raise KeyboardInterrupt

    if interrupt_at is None:
        ampnb.doctor(model, data(), CE, optimizer=opt, progress=progress, **FAST)
    else:
        with pytest.raises(KeyboardInterrupt):
            ampnb.doctor(model, data(), CE, optimizer=opt, progress=progress, **FAST)
    assert all(g is not None and torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    after = opt.state_dict()
    assert state["param_groups"] == after["param_groups"]
    for k, st in state["state"].items():
        assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(after["state"][k][n]))
                   for n, v in st.items())


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_untouched_when_interrupted_between_modes(stage):
    model, opt = _trained()
    before = _picture(model, opt)
    seen = []

    def progress(text):
        seen.append(text)
        if len(seen) > stage:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ampnb.doctor(model, data(), CE, optimizer=opt, progress=progress, **FAST)
    _same(before, _picture(model, opt))


@pytest.mark.parametrize("kwargs, words", [
    (dict(modes=("32-true", "bf17-mixed")), "bf17-mixed"),
    (dict(tolerance=-1), "tolerance=-1"),
    (dict(tolerance="loose"), "tolerance='loose'"),
    (dict(repeat=0), "repeat=0"),
    (dict(device="cuda:7"), "cuda"),
])
def test_bad_input_is_one_line_and_changes_nothing(kwargs, words):
    model, opt = _trained()
    before = _picture(model, opt)
    with pytest.raises(ValueError, match=None) as e:
        ampnb.doctor(model, data(), CE, optimizer=opt, **{**dict(repeat=1, profile=False), **kwargs})
    assert words in str(e.value) and "\n" not in str(e.value)
    _same(before, _picture(model, opt))


def test_bad_model_and_optimizer():
    with pytest.raises(ValueError, match="nn.Module"):
        ampnb.doctor(lambda x: x, data(), CE)
    with pytest.raises(ValueError, match="optimizer=SGD"):
        ampnb.doctor(Plain(), data(), CE, optimizer=torch.optim.SGD)
    with pytest.raises(ValueError, match="batch"):
        ampnb.doctor(Plain(), None, CE)


def test_doctor_is_a_plain_function_and_profile_step_lives_in_diagnosis():
    import inspect

    from ampnb.diagnosis import doctor
    from ampnb.diagnosis.why import profile_step

    assert inspect.isfunction(ampnb.doctor) and ampnb.doctor is doctor
    assert ampnb.diagnosis.profile_step is profile_step
    assert "tolerance" in str(inspect.signature(ampnb.doctor))
    assert not hasattr(ampnb.doctor, "profile_step") and not hasattr(ampnb.doctor, "replay")


def test_profile_step_splits_op_time_by_dtype():
    model, opt = _trained()
    before = _picture(model, opt)
    prof = ampnb.diagnosis.profile_step(model, data(), CE, optimizer=opt,
                                     modes=("32-true", "bf16-mixed"))
    _same(before, _picture(model, opt))
    ref, bf16 = prof.profiles
    assert ref.by_dtype.get("bf16", 0) == 0 and ref.by_dtype["fp32"] > 0
    assert bf16.by_dtype["bf16"] > 0 and bf16.cast_s > 0
    assert ("addmm", (8, 32, 4)) in ref.unaligned  # Linear(32, 4) on a batch of 8: 4 % 8 != 0
    assert "op time by dtype" in repr(prof)


def test_restore_pops_a_dispatch_mode_left_behind():
    """The safety net: a mode pushed inside torch's set-up and never popped is popped on exit."""
    from ampnb.fp16_kernels import Fp16KernelEmulation
    from ampnb.putback_state import globals_kept

    state = snapshot()
    with globals_kept():
        Fp16KernelEmulation().__enter__()  # as if an interrupt cut its with-block short
        torch.set_default_dtype(torch.float64)
        assert snapshot() != state
    assert snapshot() == state
