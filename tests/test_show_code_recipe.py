"""The generated torch.amp recipe is the one step, and the three code generators agree."""

from __future__ import annotations

import copy

import pytest
import torch

from ampnb.batch import as_batch
from ampnb.diagnosis.code import code as doctor_code
from ampnb.distributed.code import take_home
from ampnb.magics.show_code import show_code
from ampnb.modes import MODES, get_mode
from ampnb.precision import Precision
from ampnb.recipe_code import Loop, accelerator_call, lightning_precision, recipe, step_lines
from ampnb.step import StepSettings, step_context, train_step

MODES_RUN = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")


def _work():
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / 3)
    loader = [(torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g)) for _ in range(3)]
    return model, loader


def loss_fn(out, y):
    return torch.nn.functional.mse_loss(out.float(), y)


@pytest.mark.parametrize("clip", [None, 0.5])
@pytest.mark.parametrize("mode", MODES_RUN)
def test_the_recipe_trains_as_the_one_step(mode, clip):
    """exec the recipe's lines; train_step (the mode's hooks) gives the same weights, bit for bit."""
    m = get_mode(mode)
    model, loader = _work()
    mine = m.convert_module(copy.deepcopy(model))
    opt = torch.optim.SGD(mine.parameters(), lr=0.1, momentum=0.9)
    p = Precision.of(m, device="cpu")
    clip_grads = (lambda: torch.nn.utils.clip_grad_norm_(mine.parameters(), max_norm=clip)) \
        if clip else None
    # fp16 products in torch's own kernels, as the plain recipe runs them
    with step_context(StepSettings(p, fp16_kernels="native")):
        for x, y in loader:
            train_step(p, mine, opt, as_batch((x, y), loss_fn), loss_fn, before_update=clip_grads)
    src = "\n".join(recipe(m, Loop(device_type='"cpu"', clip=clip)))
    theirs = copy.deepcopy(model)
    ns = dict(torch=torch, model=theirs, loader=loader, loss_fn=loss_fn,
              optimizer=torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9))
    exec(compile(src, "<recipe>", "exec"), ns)
    assert ("scaler" in ns) == m.uses_scaler
    for a, b in zip(mine.parameters(), ns["model"].parameters(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    if p.scaler is not None:
        assert ns["scaler"].get_scale() == p.scaler.get_scale()


def test_autocast_surrounds_forward_and_loss_only():
    lines = step_lines(get_mode("16-mixed"), Loop(device_type='"cuda"'))
    at = next(i for i, line in enumerate(lines) if "torch.autocast" in line)
    inside = [line for line in lines[at + 1:] if line.startswith(" " * 8)]
    assert inside == ["        loss = loss_fn(model(inputs), targets)"]
    order = [s for line in lines for s in ("scale(loss).backward()", "unscale_", "clip_grad_norm_",
                                           "scaler.step", "scaler.update", "zero_grad") if s in line]
    assert order == ["scale(loss).backward()", "unscale_", "clip_grad_norm_", "scaler.step",
                     "scaler.update", "zero_grad"]


@pytest.mark.parametrize("mode", [n for n in MODES if not n.startswith("apex")])
def test_the_three_generators_spell_a_mode_alike(mode):
    m = get_mode(mode)
    call, todo = accelerator_call(m)
    shown = show_code(m, "cpu", None, "y = lin(x)")
    assert f"# Accelerate: {call}" in shown and (todo in shown)
    assert f'L.Trainer(precision="{lightning_precision(m)}")' in shown
    doctor = doctor_code(mode, (), "cpu")
    assert f"accelerator = {call}" in doctor and f'L.Trainer(precision="{lightning_precision(m)}")' in doctor
    assert f'precision="{lightning_precision(m)}"' in take_home("ddp", mode).lightning
    want = {"32-true": "no", "16-mixed": "fp16", "bf16-mixed": "bf16", "16-true": "no",
            "bf16-true": "no", "64-true": "no", "transformer-engine": "fp8",
            "transformer-engine-float16": "fp8"}[mode]
    assert call == f'Accelerator(mixed_precision="{want}")'
    assert bool(todo) == (mode in ("16-true", "bf16-true", "64-true"))  # cast the model yourself
