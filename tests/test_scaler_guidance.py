"""Each classic mistake yields torch's own message beside plain words with measured figures."""

from __future__ import annotations

import re

import pytest
import torch
from test_scaler import make

from ampnb import putback_state
from ampnb.formats import get_format
from ampnb.scaler import GUIDANCE, ScalerStepper, diagnose, explain, explain_error


def _scaled_backward() -> tuple[torch.amp.GradScaler, torch.optim.Optimizer]:
    """One fp16-autocast forward and a scaled backward, written out with plain torch."""
    model, opt, loss_fn, batches = make()
    scaler = torch.amp.GradScaler("cpu")
    x, y = batches[0]
    with torch.autocast("cpu", dtype=torch.float16):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    return scaler, opt


def _torch_unscale_twice_message() -> str:
    scaler, opt = _scaled_backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError) as err:
        scaler.unscale_(opt)
    return str(err.value)


@pytest.mark.parametrize("case", list(GUIDANCE))
def test_every_case_explains_itself(case):
    before = putback_state.torch_state()
    g = explain(case)
    assert putback_state.torch_state() == before
    assert g.case == case and g.title == GUIDANCE[case].title
    assert g.plain_words and g.fix and not re.search(r"\{\w+\}", g.plain_words)
    if GUIDANCE[case].match:  # torch itself speaks up in these cases
        assert GUIDANCE[case].match in g.torch_says
    assert g.title in repr(g) and "torch says" in g._repr_html_()


def test_unscale_twice_shows_torchs_own_message():
    g = explain("unscale_twice")
    assert g.torch_says == _torch_unscale_twice_message()
    assert f"{torch.amp.GradScaler('cpu').get_scale():g}" in g.plain_words


def _torch_update_without_step_message() -> str:
    scaler, _ = _scaled_backward()
    with pytest.raises(AssertionError) as err:
        scaler.update()
    return str(err.value)


def _torch_fp16_grads_message() -> str:
    model, opt, loss_fn, batches = make()
    model.half()
    scaler = torch.amp.GradScaler("cpu")
    x, y = batches[0]
    scaler.scale(loss_fn(model(x.half()), y.half())).backward()
    with pytest.raises(ValueError) as err:
        scaler.unscale_(opt)
    return str(err.value)


def _torch_scheduler_warning() -> str:
    model, opt, loss_fn, batches = make()
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)  # the first step overflows
    x, y = batches[0]
    with torch.autocast("cpu", dtype=torch.float16):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    with pytest.warns(UserWarning, match="lr_scheduler") as caught:
        scaler.step(opt)
        scaler.update()
        scheduler.step()
    return next(str(w.message) for w in caught if "lr_scheduler" in str(w.message))


# case -> torch's own words, from the same mistake written out by hand (None: torch is silent).
TORCH_SAYS = {"unscale_twice": _torch_unscale_twice_message,
              "update_without_step": _torch_update_without_step_message,
              "fp16_grads": _torch_fp16_grads_message,
              "scheduler_before_step": _torch_scheduler_warning,
              "clip_scaled": None, "scale_collapse": None, "bf16_no_scaler": None}


def test_every_case_is_checked_against_a_hand_written_mistake():
    assert set(TORCH_SAYS) == set(GUIDANCE)


@pytest.mark.parametrize("case", list(TORCH_SAYS))
def test_torch_says_exactly_what_a_hand_written_mistake_gets(case):
    g = explain(case)
    reference = TORCH_SAYS[case]
    assert g.torch_says == ("" if reference is None else reference())
    if reference is None:  # silent mistakes say so, instead of showing an empty message
        assert "torch says nothing" in repr(g)
    else:  # and a user's own error or warning is recognised as the same case
        assert explain_error(g.torch_says).case == case


def test_explain_error_maps_a_real_torch_error():
    message = _torch_unscale_twice_message()
    g = explain_error(RuntimeError(message))
    assert g is not None and g.case == "unscale_twice" and g.torch_says == message
    assert explain_error(ValueError("something else")) is None


def test_clip_scaled_figures_match_the_scale():
    g = explain("clip_scaled")
    numbers = dict(re.findall(r"(norm of|smaller than the) ([0-9.e+-]+)", g.plain_words))
    wrong, right = float(numbers["norm of"]), float(numbers["smaller than the"])
    # Clipping scaled gradients to 1.0 then unscaling leaves 1.0 / scale.
    assert wrong == pytest.approx(1.0 / 2.0**16, rel=1e-3)
    assert right == pytest.approx(1.0, rel=1e-3)


def test_scale_collapse_and_ranges_come_from_formats():
    g = explain("scale_collapse")
    assert f"{get_format('fp16').max:g}" in g.plain_words
    assert "20 of 20 steps overflowed" in g.plain_words
    assert f"{2.0**16 * 0.5**20:g}" in g.plain_words


def test_diagnose_finds_collapse_and_skipped_first_step():
    model, opt, loss_fn, batches = make(huge=(0, 1, 2, 3, 4))  # every batch overflows fp16
    stepper = ScalerStepper(model, opt, loss_fn, batches, init_scale=4.0)
    history = stepper.run(6)
    assert all(r.skipped for r in history) and history[-1].new_scale < 1
    cases = [g.case for g in diagnose(stepper)]
    assert cases == ["scheduler_before_step", "scale_collapse"]
    skipped_first, collapse = diagnose(stepper)
    assert f"{history[-1].new_scale:g}" in collapse.plain_words
    # the skipped first step is described with this run's scales, not the demo's
    assert f"scale {history[0].scale:g} " in skipped_first.plain_words
    assert f"backed off to {history[0].new_scale:g} " in skipped_first.plain_words


def test_unknown_case():
    with pytest.raises(ValueError, match="case='nope'"):
        explain("nope")


def test_explain_leaves_the_global_random_stream_alone():
    from ampnb.scaler import guidance

    guidance._explain.cache_clear()  # really run the demo, not the cached result
    rng = torch.get_rng_state()
    explain("scale_collapse")
    assert torch.equal(torch.get_rng_state(), rng)


def test_diagnose_says_nothing_for_fp32():
    model, opt, loss_fn, batches = make()
    stepper = ScalerStepper(model, opt, loss_fn, batches, mode="32-true")
    stepper.run(1)
    assert stepper.enabled is False and diagnose(stepper) == []
