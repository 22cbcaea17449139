"""Workbench against hand-written loops: per-mode dtypes and losses, restore, bad input, state."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from _workbench_kit import (
    CPU_MODES,
    HAND,
    hand_loop,
    make,
    needs_cuda,
    opt_state,
    same,
    same_floats,
    same_opt,
    weights,
)

from ampnb import putback_state
from ampnb.workbench import PrecisionLossWarning, Workbench


@pytest.mark.parametrize("mode", list(HAND))
def test_losses_dtypes_and_weights_match_a_hand_written_loop(mode):
    # Same ops on the same CPU in the same order, so equality is exact, not approximate.
    losses, skipped, out_dtypes, final = hand_loop(mode, steps=4)
    wb = Workbench(*make(), mode=mode)
    records = wb.run(4)
    # 16-true with Adam goes NaN after one step (eps=1e-8 is 0 in fp16): the same in both.
    assert same_floats([r.loss for r in records], losses)
    assert [r.skipped for r in records] == skipped
    assert [r.output_dtype for r in records] == out_dtypes
    assert all(r.param_dtype == HAND[mode][0] and r.mode == mode for r in records)
    assert same(weights(wb.model), final)


@pytest.mark.parametrize("mode", ["16-mixed", "16-true"])
@pytest.mark.parametrize("kernels", ["native", "emulated"])
def test_fp16_kernels_switch_matches_a_hand_written_loop_with_the_same_kernels(mode, kernels):
    losses, skipped, _, final = hand_loop(mode, steps=3, kernels=kernels)
    wb = Workbench(*make(), mode=mode)
    wb.set(fp16_kernels=kernels)
    records = wb.run(3)
    assert wb.fp16_kernels == kernels
    assert same_floats([r.loss for r in records], losses)
    assert [r.skipped for r in records] == skipped
    assert same(weights(wb.model), final)
    assert ("emulated in fp32" in records[0].kernels) == (kernels == "emulated")
    assert ("emulated in fp32" in wb.table().notes[-1]) == (kernels == "emulated")


def test_fp16_kernels_bad_value_is_refused_and_nothing_changes():
    wb = Workbench(*make(), mode="16-mixed")
    before = wb.fp16_kernels
    with pytest.raises(ValueError, match="allowed: auto, native, emulated"):
        wb.set(mode="bf16-mixed", fp16_kernels="fast")
    assert wb.fp16_kernels == before and wb.mode.name == "16-mixed"


def test_16_mixed_skips_overflow_like_torch_and_keeps_the_scale_across_switches():
    losses, skipped, _, final = hand_loop("16-mixed", steps=3, huge=(1,))
    wb = Workbench(*make(huge=(1,)), mode="16-mixed")
    records = wb.run(3)
    assert [r.skipped for r in records] == skipped and any(skipped)
    assert same_floats([r.loss for r in records], losses)
    assert same(weights(wb.model), final)
    scale = wb.scaler.get_scale()
    assert scale < records[0].scale  # backed off after the overflow
    wb.set(mode="bf16-mixed")
    assert wb.scaler is None
    wb.set(mode="16-mixed")
    assert wb.scaler.get_scale() == scale


def test_mode_given_by_alias_and_inferred_from_the_model():
    assert Workbench(*make(), mode=16).mode.name == "16-mixed"
    model, _, loss_fn, batches = make()
    model.to(torch.bfloat16)
    wb = Workbench(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, batches)
    assert wb.mode.name == "bf16-true" and wb.param_dtype == torch.bfloat16


# ----- restore, bad input, global state ---------------------------------------------------

def test_restore_returns_to_the_start():
    wb = Workbench(*make())
    start, start_opt = weights(wb.model), opt_state(wb.optimizer)
    first = [r.loss for r in wb.run(2)]
    wb.set(mode="bf16-true", tf32=True)
    wb.run(2)
    with pytest.warns(PrecisionLossWarning):
        wb.set(mode="16-mixed")
    wb.step()
    wb.restore()
    assert same(weights(wb.model), start) and same_opt(opt_state(wb.optimizer), start_opt)
    assert (wb.mode.name, str(wb.device), wb.tf32, wb.history, wb.notes) == (
        "32-true", "cpu", False, [], [])
    assert [r.loss for r in wb.run(2)] == first


@pytest.mark.parametrize("bad, match", [
    (dict(mode="fp17"), "fp17"),
    (dict(device="cuda:7" if torch.cuda.is_available() else "cuda"), "cuda"),
    (dict(device="tpu"), "tpu"),
    (dict(tf32="yes"), "tf32"),
    (dict(mode="bf16-true", tf32=1), "tf32"),
])
def test_bad_settings_raise_one_line_and_change_nothing(bad, match):
    wb = Workbench(*make())
    wb.run(2)
    before, before_opt, state = weights(wb.model), opt_state(wb.optimizer), putback_state.torch_state()
    with pytest.raises(ValueError, match=match) as err:
        wb.set(**bad)
    assert "\n" not in str(err.value)
    assert same(weights(wb.model), before) and same_opt(opt_state(wb.optimizer), before_opt)
    assert (wb.mode.name, wb.tf32, putback_state.torch_state()) == ("32-true", False, state)


def test_bad_construction_raises_and_leaves_the_model_alone():
    model, opt, loss_fn, batches = make()
    before = weights(model)
    other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    cases = [dict(optimizer=other), dict(batches=[]), dict(loss_fn=3), dict(mode="nope"),
             dict(device="cuda:9"), dict(tf32="yes"), dict(batches=[torch.ones(2)])]
    for case in cases:
        args = dict(model=model, optimizer=opt, loss_fn=loss_fn, batches=batches) | case
        with pytest.raises(ValueError):
            Workbench(**args)
    assert same(weights(model), before) and opt.state_dict()["state"] == {}


@pytest.mark.parametrize("mode", CPU_MODES)
@pytest.mark.parametrize("tf32", [False, True])
def test_global_state_restored_after_a_step_and_a_raising_loss(mode, tf32):
    state = putback_state.torch_state()
    wb = Workbench(*make(), mode=mode, tf32=tf32)
    wb.step()
    assert putback_state.torch_state() == state
    before = weights(wb.model)

    def broken(out, y):
        raise RuntimeError("loss exploded")

    wb.loss_fn = broken
    with pytest.raises(RuntimeError, match="loss exploded"):
        wb.step()
    assert putback_state.torch_state() == state
    assert same(weights(wb.model), before) and len(wb.history) == 1


# ----- measurements -----------------------------------------------------------------------

def test_memory_follows_element_size_and_speedup_is_from_the_records():
    wb = Workbench(*make())
    saved = {}
    with pytest.warns(PrecisionLossWarning):  # leaving bf16-true and 64-true after a step
        for mode in ("bf16-true", "32-true", "64-true", "bf16-mixed"):
            wb.set(mode=mode)
            saved[mode] = wb.step().memory
    assert 0 < saved["bf16-true"] < saved["32-true"] < saved["64-true"]
    assert wb.history[-1].cuda_peak is None
    wb.set(mode="16-true")
    assert wb.speedup() is None  # no 16-true steps yet
    wb.set(mode="bf16-mixed")
    wb.run(3)
    wb.set(mode="32-true")
    wb.run(3)
    wb.set(mode="bf16-mixed")

    def median(mode):
        return statistics.median(r.seconds for r in wb.history
                                 if r.mode == mode and not r.first_after_switch)

    ref, cur = median("32-true"), median("bf16-mixed")
    assert wb.speedup() == ref / cur
    only_bf16 = Workbench(*make(), mode="bf16-mixed")
    only_bf16.run(2)
    assert only_bf16.speedup() is None  # no 32-true reference measured yet


def test_demo_model_trains():
    from ampnb.models import demo

    wb = Workbench(*demo("mlp", seed=0, n_batches=2, batch_size=32))
    wb.set(mode="bf16-mixed")
    records = wb.run(4)
    assert all(r.output_dtype == torch.bfloat16 for r in records)
    assert "bf16-mixed" in repr(wb) and "bf16-mixed" in wb._repr_html_()


@needs_cuda
def test_cuda_round_trip_is_lossless_and_measures_peak():
    wb = Workbench(*make())
    wb.run(1)
    before = weights(wb.model)
    wb.set(device="cuda", mode="16-true")
    record = wb.step()
    assert record.device.startswith("cuda") and record.cuda_peak > 0
    wb.restore()
    wb.run(1)
    wb.set(device="cuda", mode="bf16-mixed")
    wb.set(device="cpu", mode="32-true")
    assert same(weights(wb.model), before)


# ----- batches in any form, the model's own loss, non-finite weights ----------------------


class _OwnLoss(torch.nn.Module):
    """Called with keyword inputs; returns a dict holding its own loss (like a ModelOutput)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 4)

    def forward(self, x, target):
        out = self.net(x)
        return {"logits": out, "loss": torch.nn.functional.mse_loss(out.float(), target)}


def test_dict_batches_with_the_models_own_loss_match_a_hand_loop():
    gen = torch.Generator().manual_seed(0)
    batches = [{"x": torch.randn(16, 8, generator=gen), "target": torch.randn(16, 4, generator=gen)}
               for _ in range(2)]
    torch.manual_seed(0)
    ref = _OwnLoss()
    model = _OwnLoss()
    model.load_state_dict(ref.state_dict())
    wb = Workbench(model, torch.optim.Adam(model.parameters(), lr=1e-2), None, batches)
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    losses = []
    for i in range(3):
        opt.zero_grad(set_to_none=True)
        loss = ref(**batches[i % 2])["loss"]
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert [r.loss for r in wb.run(3)] == losses and same(weights(wb.model), weights(ref))
    assert wb.history[0].output_dtype == torch.float32
    other = _OwnLoss()
    again = Workbench(other, torch.optim.SGD(other.parameters(), lr=0.1), None, iter(batches))
    assert again.batches == batches and again.run(2)  # an iterator is read once, into a list


@pytest.mark.parametrize("bad", [None, 3, [], [None]])
def test_bad_batches_are_a_value_error_naming_what_is_allowed(bad):
    model, opt, loss_fn, _ = make()
    before = weights(model)
    with pytest.raises(ValueError, match="allowed"):
        Workbench(model, opt, loss_fn, bad)
    assert same(weights(model), before)


def _nan_maker():
    """16-true + AdamW: fp16 eps underflows to 0, so a weight with zero gradient becomes 0/0."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    x = torch.zeros(8, 4)  # the weight's gradient is exactly zero; the bias's is not
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), [(x, torch.ones(8, 2))]


def test_nonfinite_weights_are_flagged_in_the_step_that_made_them():
    model, opt, batches = _nan_maker()
    wb = Workbench(model, opt, torch.nn.functional.mse_loss, batches, mode="16-true")
    first = wb.step()
    # reference: what the step left in the weights, read with torch itself
    bad = [n for n, p in wb.model.named_parameters() if not torch.isfinite(p).all()]
    assert bad == ["0.weight"] and math.isfinite(first.loss)
    assert first.nonfinite == ("0.weight",)
    assert any("0.weight" in n and "16-true" in n for n in first.notes)
    assert "inf/NaN" in repr(wb.table())
    with pytest.warns(PrecisionLossWarning):
        wb.set(mode="32-true")
    second = wb.step()  # the NaN shows in the loss now; it was made (and said) one step earlier
    assert math.isnan(second.loss) and "0.weight" in second.nonfinite


def test_finite_steps_flag_nothing():
    model, opt, loss_fn, batches = make()
    wb = Workbench(model, opt, loss_fn, batches, mode="bf16-mixed")
    assert all(r.nonfinite == () for r in wb.run(3))


# ----- one memory meter -----------------------------------------------------------------


def test_step_probe_memory_report_and_memory_meter_report_the_same_saved_bytes():
    from ampnb.instruments.memory import memory_meter, memory_report

    model, opt, loss_fn, batches = make(n_batches=1)
    x, y = batches[0]
    with memory_meter() as hand:
        loss_fn(model(x), y)
    report = memory_report(model, batches[0], loss_fn, modes=["32-true"])
    wb = Workbench(model, opt, loss_fn, batches)
    probed = wb.probe(memory_meter)
    record = wb.step()
    assert hand.peak_bytes > 0
    assert record.memory == probed.peak_bytes == report.stats[0].saved_bytes == hand.peak_bytes


def _hand_keep_last_in_fp32(mode: str, steps: int):
    """The hand loop with the last Linear in a hand-written autocast(enabled=False) region
    (bf16-mixed), or with fp32 weights and casts at its boundary (bf16-true)."""
    model, _, loss_fn, batches = make()
    head = model[2]
    body = torch.nn.Sequential(model[0], model[1])
    true = mode == "bf16-true"
    if true:
        body.to(torch.bfloat16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for i in range(steps):
        x, y = batches[i % len(batches)]
        opt.zero_grad(set_to_none=True)
        if true:
            old = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)
            try:
                out = head(body(x.bfloat16()).float()).bfloat16()
            finally:
                torch.set_default_dtype(old)
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = body(x.bfloat16())
                with torch.autocast("cpu", enabled=False):
                    out = head(h.float())
        loss = loss_fn(out.float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, weights(model)


@pytest.mark.parametrize("mode", ["bf16-mixed", "bf16-true"])
def test_keep_fp32_matches_a_hand_written_fp32_region(mode):
    losses, final = _hand_keep_last_in_fp32(mode, steps=3)
    wb = Workbench(*make(), mode=mode)
    wb.set(keep_fp32="2")
    records = wb.run(3)
    assert wb.keep_fp32 == ("2",) and records[-1].keep_fp32 == ("2",)
    assert same_floats([r.loss for r in records], losses)
    assert same(weights(wb.model), final)
    assert wb.model[2].weight.dtype == torch.float32
    assert wb.model[0].weight.dtype == (torch.bfloat16 if mode == "bf16-true" else torch.float32)


def test_keep_fp32_cleared_and_bad_patterns_refused_without_change():
    wb = Workbench(*make(), mode="bf16-true")
    wb.set(keep_fp32="2")
    with pytest.raises(ValueError, match="matches no module"):
        wb.set(mode="16-true", keep_fp32="lm_head")
    assert wb.keep_fp32 == ("2",) and wb.mode.name == "bf16-true"
    assert wb.model[2].weight.dtype == torch.float32
    wb.set(keep_fp32="")
    assert wb.keep_fp32 == () and wb.model[2].weight.dtype == torch.bfloat16
