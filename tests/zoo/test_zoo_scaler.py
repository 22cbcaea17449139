"""ScalerStepper on zoo models equals nanoGPT's AMP loop written by hand, bit for bit.

The models stay in train() mode with dropout on, as transformers builds them: both loops are
seeded the same way (torch.manual_seed before each run) and draw their dropout masks in the same
order, so the comparison covers dropout too instead of switching it off with eval().
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from zoo_models import BUILDERS, Case

from ampnb import putback_state
from ampnb.fp16_kernels import emulated_fp16_kernels, emulates_fp16
from ampnb.scaler import ScalerStepper

ACCUM, CLIP, SEED = 2, 1.0, 1234
DTYPES = {"bf16-mixed": torch.bfloat16, "32-true": None, "16-mixed": torch.float16}
SCALER = dict(init_scale=2.0**10, growth_interval=1)  # small interval: growth shows in 3 steps


def plain_loop(case: Case, mode: str, steps: int, inject: tuple[int, int] | None = None):
    """nanoGPT's order: autocast forward, loss / accum, scale+backward, unscale_, clip, step,
    update, zero_grad. inject=(step, micro-step): fill every gradient with inf after backward."""
    model, opt, dtype = case.model, case.optimizer(), DTYPES[mode]
    scaler = torch.amp.GradScaler("cpu", enabled=mode == "16-mixed", **SCALER)
    scales, skipped = [], []
    torch.manual_seed(SEED)
    for step in range(steps):
        for micro in range(ACCUM):
            context = torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()
            # fp16 products as ampnb runs them on this CPU (emulated where it has no fp16 units)
            emulate = dtype == torch.float16 and emulates_fp16("cpu")
            with emulated_fp16_kernels(emulate), context:
                if case.loss_fn is None:
                    loss = model(**case.batch).loss / ACCUM
                else:
                    x, y = case.batch
                    loss = case.loss_fn(model(x), y) / ACCUM
            with emulated_fp16_kernels(emulate):
                scaler.scale(loss).backward()
            if inject == (step, micro):
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.fill_(float("inf"))
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        scales.append(scaler.get_scale())
        skipped.append(all(torch.equal(a, p) for a, p in zip(before, model.parameters())))
    return scales, skipped


def make_stepper(case: Case, mode: str) -> ScalerStepper:
    return ScalerStepper(case.model, case.optimizer(), case.loss_fn, [case.batch], mode=mode,
                         accumulation_steps=ACCUM, clip_norm=CLIP, **SCALER)


def stepper_run(case: Case, mode: str, steps: int, inject: tuple[int, int] | None = None):
    stepper = make_stepper(case, mode)
    torch.manual_seed(SEED)
    for step in range(steps):
        if inject and inject[0] == step:
            for _ in range(3 * inject[1]):  # forward, divide, backward per micro-step
                stepper.next_stage()
            stepper.inject("inf")
        stepper.step()
    return stepper


def _same(case: Case, mode: str, steps: int, inject=None) -> ScalerStepper:
    ref = BUILDERS[case.name]()  # the builders seed themselves: the same initial weights
    try:
        scales, skipped = plain_loop(ref, mode, steps, inject)
    except RuntimeError as err:  # torch itself refuses on some CPUs (oneDNN's bf16 nn.LSTM)
        stepper, before = make_stepper(case, mode), putback_state.torch_state()
        with pytest.raises(RuntimeError) as same:
            stepper.step()
        assert str(same.value) == str(err)
        assert stepper.next_stage_name == "forward" and not stepper.stages
        assert putback_state.torch_state() == before
        pytest.skip(f"plain torch raised on this CPU ({str(err)[:60]}...); the stepper raised "
                    f"the same and changed nothing")
    stepper = stepper_run(case, mode, steps, inject)
    assert [r.new_scale for r in stepper.history] == scales
    assert [r.skipped for r in stepper.history] == skipped
    for (name, a), b in zip(case.model.named_parameters(), ref.model.parameters()):
        assert torch.equal(a, b), name
    return stepper


@pytest.mark.parametrize("mode", ["bf16-mixed", "32-true"])
@pytest.mark.parametrize("name", ["gpt2", "bert", "llama", "lstm"])
def test_stepper_equals_the_plain_loop(name, mode):
    case = BUILDERS[name]()
    stepper = _same(case, mode, steps=2)
    forward = [line.strip() for stage, line in stepper.listing() if stage == "forward"]
    call = ("loss = model(**batch).loss" if case.loss_fn is None
            else "loss = loss_fn(model(x), y)")
    assert forward[-1] == call
    assert not any(r.skipped for r in stepper.history)


def test_16_mixed_with_an_injected_inf_equals_the_plain_loop():
    # fp16 on a CPU is slow: three steps of the zoo model quickest under fp16 here (oneDNN
    # builds no fp16 nn.LSTM on some CPUs, so not the LSTM).
    stepper = _same(BUILDERS["llama"](), "16-mixed", steps=3, inject=(1, 1))
    assert [r.skipped for r in stepper.history] == [False, True, False]
    assert stepper.history[1].new_scale == stepper.history[1].scale / 2
