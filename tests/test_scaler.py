"""ScalerStepper against a plain, hand-written torch.amp loop: same scales, skips, parameters."""

from __future__ import annotations

import dataclasses
import io
import itertools
from typing import NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ampnb.fp16_kernels import emulated_fp16_kernels, emulates_fp16
from ampnb.scaler import STAGES, ScalerStepper

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))]


def make(seed: int = 0, device: str = "cpu", opt: str = "adamw", n_batches: int = 5,
         huge: tuple[int, ...] = ()):
    """A tiny MLP, its optimizer and batches; batch i in `huge` overflows fp16 in the forward."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 4)).to(device)
    optim = (torch.optim.AdamW(model.parameters(), lr=1e-2) if opt == "adamw"
             else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    batches = []
    for i in range(n_batches):
        x = torch.randn(16, 8, generator=gen) * (1e5 if i in huge else 1.0)
        batches.append((x.to(device), torch.randn(16, 4, generator=gen).to(device)))
    return model, optim, torch.nn.functional.mse_loss, batches


class Plain(NamedTuple):
    """What the hand-written loop saw, per optimizer step."""

    scales: list[float]         # the scale after update()
    skipped: list[bool]         # the parameters did not change
    losses: list[tuple[float, ...]]  # each micro-step's loss, before the division
    norms: list[float]          # the unscaled gradients' total norm (clip_grad_norm_'s answer)


def plain_loop(model, optim, loss_fn, batches, steps, accum=1, clip=None, inject=None,
               device="cpu", dtype=torch.float16, scaler_on=True, **scaler_kw) -> Plain:
    """nanoGPT's AMP loop written out by hand, with torch's recipe and nothing of ampnb's but the
    fp16 products (run as ampnb runs them on this CPU: emulated where it has no fp16 units).

    inject: (step, micro, kind, layer or None), or a list of them: fill those gradients after
    that micro-step's backward.
    """
    injections = [inject] if isinstance(inject, tuple) else list(inject or ())
    scaler = torch.amp.GradScaler(device, enabled=scaler_on, **scaler_kw)
    data = itertools.cycle(batches)
    out = Plain([], [], [], [])
    emulate = dtype == torch.float16 and emulates_fp16(device)
    with emulated_fp16_kernels(emulate):
        for step in range(steps):
            losses = []
            for micro in range(accum):
                x, y = next(data)
                with torch.autocast(device, dtype=dtype):
                    loss = loss_fn(model(x), y)
                    losses.append(loss.item())
                    loss = loss / accum
                scaler.scale(loss).backward()  # outside autocast, as torch's recipe says
                for at_step, at_micro, kind, layer in injections:
                    if (at_step, at_micro) == (step, micro):
                        target = model if layer is None else model.get_submodule(layer)
                        with torch.no_grad():
                            for p in target.parameters():
                                p.grad.fill_(float(kind))
            scaler.unscale_(optim)
            if clip:  # clip_grad_norm_ answers the norm before clipping
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            else:
                norm = torch.linalg.vector_norm(torch.cat([p.grad.flatten().float()
                                                           for p in model.parameters()]))
            before = [p.detach().clone() for p in model.parameters()]
            scaler.step(optim)
            scaler.update()
            optim.zero_grad(set_to_none=True)
            out.skipped.append(all(torch.equal(a, p) for a, p in zip(before, model.parameters())))
            out.scales.append(scaler.get_scale())
            out.losses.append(tuple(losses))
            out.norms.append(float(norm))
    return out


CASES = {
    "plain": dict(),
    "accumulation": dict(accum=3),
    "clipping": dict(clip=0.05),
    "accumulation+clipping": dict(accum=2, clip=0.05),
    "clip_norm far above the norm": dict(clip=1e3),
    "natural overflow": dict(huge=(2,)),
    "natural overflow, accumulation+clipping": dict(accum=2, clip=0.05, huge=(3,)),
    "injected inf": dict(inject=(1, 0, "inf", None)),
    "injected nan in one layer, accumulation": dict(accum=2, inject=(2, 1, "nan", "2")),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_plain_torch_amp_loop(case, device):
    kw = dict(CASES[case])
    huge, inject = kw.pop("huge", ()), kw.pop("inject", None)
    accum, clip = kw.get("accum", 1), kw.get("clip")
    sk = dict(init_scale=2.0**10, growth_interval=2, backoff_factor=0.25, growth_factor=4.0)
    steps = 6
    ref_model, ref_opt, loss_fn, batches = make(device=device, huge=huge)
    ref = plain_loop(ref_model, ref_opt, loss_fn, batches, steps, accum, clip, inject, device, **sk)
    model, opt, loss_fn, batches = make(device=device, huge=huge)
    stepper = ScalerStepper(model, opt, loss_fn, batches, accumulation_steps=accum,
                            clip_norm=clip, **sk)
    for step in range(steps):
        if inject and inject[0] == step:
            for _ in range(3 * inject[1]):  # advance to the chosen micro-step
                stepper.next_stage()
            stepper.inject(inject[2], inject[3])
        stepper.step()
    assert [r.new_scale for r in stepper.history] == ref.scales
    assert [r.skipped for r in stepper.history] == ref.skipped
    # every micro-step, bit for bit (as text: an overflowed loss is NaN on both sides)
    assert repr([r.losses for r in stepper.history]) == repr(ref.losses)
    # The unscaled gradients' norm: the same gradients, summed in another order.
    assert [r.grad_norm_unscaled for r in stepper.history] == pytest.approx(
        ref.norms, rel=1e-5, nan_ok=True)
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)
    if huge or inject:  # the case really exercised a skip
        assert any(ref.skipped)
    if clip:  # small limits clip; a far larger one leaves every gradient bit as it was
        assert any(r.clipped for r in stepper.history) == (clip < 1)
        if clip >= 1:
            assert all(r.grad_norm_clipped == r.grad_norm_unscaled for r in stepper.history)


def test_stage_order_and_records():
    model, opt, loss_fn, batches = make()
    stepper = ScalerStepper(model, opt, loss_fn, batches, accumulation_steps=2)
    records = [stepper.next_stage() for _ in range(2 * 3 + 5)]
    micro = [s.name for s in STAGES if s.micro]
    rest = [s.name for s in STAGES if not s.micro]
    assert [r.stage for r in records] == micro * 2 + rest
    assert [r.micro_step for r in records[:6]] == [0, 0, 0, 1, 1, 1]
    assert stepper.mid_step is False and len(stepper.history) == 1
    forward, divide = records[0], records[1]
    assert divide.loss == pytest.approx(forward.loss / 2, rel=1e-6)
    scaled, unscaled = records[5].grads, records[6].grads
    # Unscaling divides by a power of two: the statistics scale exactly with it.
    assert unscaled.norm == pytest.approx(scaled.norm / stepper.history[0].scale, rel=1e-6)
    assert unscaled.max_abs == scaled.max_abs / stepper.history[0].scale
    assert records[-1].stage == "zero_grad" and all(p.grad is None for p in model.parameters())
    assert stepper.history[0].losses == (records[0].loss, records[3].loss)


def test_skipped_step_leaves_parameters_and_optimizer_bit_identical():
    model, opt, loss_fn, batches = make(opt="sgd")
    stepper = ScalerStepper(model, opt, loss_fn, batches, backoff_factor=0.125)
    stepper.run(2)
    params = [p.detach().clone() for p in model.parameters()]
    momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    scale = stepper.scale
    stepper.inject("nan")
    record = stepper.step()
    assert record.found_inf and record.skipped and record.injected == "nan in all"
    assert record.new_scale == scale * 0.125
    assert all(torch.equal(a, p) for a, p in zip(params, model.parameters()))
    assert all(torch.equal(m, opt.state[p]["momentum_buffer"])
               for m, p in zip(momentum, model.parameters()))


def test_growth_after_growth_interval_clean_steps():
    model, opt, loss_fn, batches = make()
    stepper = ScalerStepper(model, opt, loss_fn, batches, init_scale=2.0**8, growth_factor=4.0,
                            growth_interval=3)
    history = stepper.run(6)
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_factor=4.0, growth_interval=3)
    assert [r.growth_tracker for r in history] == [1, 2, 0, 1, 2, 0]
    assert [r.new_scale for r in history] == [2.0**8] * 2 + [2.0**8 * 4] * 3 + [2.0**8 * 16]
    assert history[0].scale == ref.get_scale()
    assert not any(r.skipped for r in history)


def test_inject_one_layer_only_touches_that_layer():
    model, opt, loss_fn, batches = make()
    stepper = ScalerStepper(model, opt, loss_fn, batches)
    assert stepper.layers == ["0", "2"]
    stepper.inject("inf", layer="2")
    records = [stepper.next_stage() for _ in range(4)]
    n_layer = sum(p.numel() for p in model[2].parameters())
    assert records[2].grads.nonfinite == n_layer
    assert records[3].found_inf is True
    with pytest.raises(ValueError, match="layer='nope'"):
        stepper.inject("inf", layer="nope")
    with pytest.raises(ValueError, match="kind='zero'"):
        stepper.inject("zero")


def test_state_dict_round_trip_resumes_identically():
    sk = dict(init_scale=2.0**12, growth_interval=2)
    model_a, opt_a, loss_fn, batches = make(seed=1)
    a = ScalerStepper(model_a, opt_a, loss_fn, batches, accumulation_steps=2, clip_norm=0.1, **sk)
    a.run(1)
    a.inject("inf")
    a.run(5)
    model_b, opt_b, _, _ = make(seed=1)
    b = ScalerStepper(model_b, opt_b, loss_fn, batches, accumulation_steps=2, clip_norm=0.1, **sk)
    b.run(1)
    b.inject("inf")
    b.run(2)
    saved = b.state_dict()
    model_c, opt_c, _, _ = make(seed=7)  # different weights: everything must come from `saved`
    c = ScalerStepper(model_c, opt_c, loss_fn, batches)
    c.load_state_dict(saved)
    assert c.settings == a.settings and c.scale == b.scale
    c.run(3)
    assert [r.new_scale for r in c.history] == [r.new_scale for r in a.history]
    assert [r.growth_tracker for r in c.history] == [r.growth_tracker for r in a.history]
    assert all(torch.equal(p, q) for p, q in zip(model_a.parameters(), model_c.parameters()))
    c.next_stage()
    with pytest.raises(ValueError, match="middle of step"):
        c.state_dict()


def test_checkpoint_survives_torch_save_and_a_weights_only_load():
    model, opt, loss_fn, batches = make(seed=2)
    a = ScalerStepper(model, opt, loss_fn, batches, init_scale=2.0**10, growth_interval=2)
    a.inject("inf")
    a.run(3)
    buffer = io.BytesIO()
    torch.save(a.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)  # torch's safe default: plain data only
    model_b, opt_b, _, _ = make(seed=5)
    b = ScalerStepper(model_b, opt_b, loss_fn, batches)
    b.load_state_dict(saved)
    assert b.history == a.history and b.growth_tracker == a.growth_tracker
    assert [r.new_scale for r in b.run(3)] == [r.new_scale for r in a.run(3)]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), model_b.parameters()))


def test_a_generator_of_batches_is_read_lazily_and_cycled():
    model, opt, loss_fn, batches = make(n_batches=3)
    pulled = []

    def stream():
        for b in batches:
            pulled.append(b)
            yield b

    lazy = ScalerStepper(model, opt, loss_fn, stream(), accumulation_steps=2)
    assert len(pulled) == 1  # only the first batch, to check its shape
    lazy.run(1)
    assert len(pulled) == 2
    lazy.run(3)  # 8 micro-steps over 3 batches: cycled after the generator ran dry
    ref_model, ref_opt, _, _ = make(n_batches=3)
    ref = plain_loop(ref_model, ref_opt, loss_fn, batches, 4, accum=2)
    assert [r.new_scale for r in lazy.history] == ref.scales
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))


def test_an_endless_generator_does_not_hang():
    model, opt, loss_fn, batches = make()
    endless = ScalerStepper(model, opt, loss_fn, itertools.cycle(batches))
    endless.run(2)
    assert len(endless.batches) == 2 and not endless._data.exhausted


def test_reset_rebuilds_from_initial_state():
    model, opt, loss_fn, batches = make()
    initial = [p.detach().clone() for p in model.parameters()]
    stepper = ScalerStepper(model, opt, loss_fn, batches)
    stepper.run(2)
    stepper.next_stage()
    with pytest.raises(ValueError, match="backoff_factor=1.5"):
        stepper.reset(backoff_factor=1.5)
    assert stepper.mid_step  # a refused reset changed nothing
    stepper.reset(init_scale=2.0**10, accumulation_steps=2)
    assert stepper.history == [] and stepper.scale == 2.0**10 and not stepper.mid_step
    assert all(torch.equal(a, p) for a, p in zip(initial, model.parameters()))
    assert not opt.state
    first = stepper.step()
    model2, opt2, _, _ = make()
    ref = ScalerStepper(model2, opt2, loss_fn, batches, init_scale=2.0**10, accumulation_steps=2)
    assert first == ref.step()


@settings(max_examples=15, deadline=None)
@given(accum=st.integers(1, 2), interval=st.integers(1, 3),
       backoff=st.sampled_from([0.5, 0.25, 0.125]), growth=st.sampled_from([2.0, 4.0]),
       inject_at=st.sets(st.integers(0, 5), max_size=3), kind=st.sampled_from(["inf", "nan"]))
def test_any_schedule_of_faults_matches_torch(accum, interval, backoff, growth, inject_at, kind):
    sk = dict(init_scale=2.0**8, growth_interval=interval, backoff_factor=backoff,
              growth_factor=growth)
    ref_model, ref_opt, loss_fn, batches = make(opt="sgd")
    # every micro-step of an injected step: the sum is inf/NaN as after the first one
    faults = [(step, micro, kind, None) for step in inject_at for micro in range(accum)]
    ref = plain_loop(ref_model, ref_opt, loss_fn, batches, 6, accum, inject=faults, **sk)
    model, opt, loss_fn, batches = make(opt="sgd")
    stepper = ScalerStepper(model, opt, loss_fn, batches, accumulation_steps=accum, **sk)
    for step in range(6):
        if step in inject_at:
            stepper.inject(kind)
        stepper.step()
    assert [r.new_scale for r in stepper.history] == ref.scales
    assert [r.skipped for r in stepper.history] == ref.skipped == [s in inject_at for s in range(6)]
    assert repr([r.losses for r in stepper.history]) == repr(ref.losses)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))


def test_one_stage_table_drives_the_plan_the_runners_and_the_listing():
    from ampnb.scaler.stages import STAGES as TABLE

    model, opt, loss_fn, batches = make()
    stepper = ScalerStepper(model, opt, loss_fn, batches, accumulation_steps=2, clip_norm=0.05)
    micro = [s for s in TABLE if s.micro]
    plan = [s.name for s in micro] * 2 + [s.name for s in TABLE if not s.micro]
    assert [s.name for s in stepper._plan] == plan
    listing = stepper.listing()
    assert list(dict.fromkeys(stage for stage, _ in listing if stage)) == [s.name for s in TABLE]
    loop = stepper._loop()
    for s in TABLE:  # every line the listing shows for a stage is that stage's code, and only it
        shown = [line.strip() for stage, line in listing if stage == s.name]
        assert shown == [line.strip() for line in s.code(loop)]
    # The runner that ran each stage is the table's: the records come back in the plan's order.
    calls = []
    stepper._plan = tuple(dataclasses.replace(
        s, run=lambda parts, state, prepared, _s=s: (calls.append(_s.name),
                                                     _s.run(parts, state, prepared))[1])
        for s in stepper._plan)
    records = [stepper.next_stage() for _ in plan]
    assert calls == [r.stage for r in records] == plan


def test_inject_into_a_frozen_layer_is_refused_and_changes_nothing():
    model, opt, loss_fn, batches = make()
    model[0].requires_grad_(False)  # a frozen layer: no gradient to make inf
    stepper = ScalerStepper(model, opt, loss_fn, batches)
    with pytest.raises(ValueError, match=r"layer='0'.*one of \['2'\]") as err:
        stepper.inject("inf", layer="0")
    assert "\n" not in str(err.value)
    assert stepper.layers == ["2"]
    record = stepper.step()
    assert record.injected == "" and not record.found_inf and not record.skipped
