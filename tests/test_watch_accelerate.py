"""ampnb.watch(model, optimizer, accelerator.scaler) in an Accelerate loop: wrappers, accumulation, skips."""

from __future__ import annotations

import math

import pytest
import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.state import AcceleratorState, GradientState
from torch import nn
from watch_models import Spike

import ampnb

K = 2
STEPS = 5


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Accelerate keeps process-wide singletons; each test starts and ends without them."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _net(at: int | None = None) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), Spike(at), nn.Linear(16, 1))


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


def _train(accelerator: Accelerator, net: nn.Module, batches, *, watched: bool,
           autocast: bool = False, log_loss: bool = False):
    model, opt = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert isinstance(opt, AcceleratedOptimizer)
    w = ampnb.watch(model, opt, accelerator.scaler) if watched else None
    losses, skipped = [], []
    try:
        for x, y in batches:
            with accelerator.accumulate(model):
                with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
                    loss = nn.functional.mse_loss(model(x).float(), y)
                if w is not None and log_loss:
                    w.log_loss(loss)
                losses.append(float(loss.detach()))
                accelerator.backward(loss)
                opt.step()
                if accelerator.sync_gradients:
                    skipped.append(opt.step_was_skipped)
                opt.zero_grad()
    finally:
        if w is not None:
            w.close()
    return w, losses, skipped


def test_an_accelerated_optimizer_is_watched_and_the_weights_are_unchanged():
    plain, watched = _net(), _net()
    _train(Accelerator(cpu=True), plain, _batches(STEPS), watched=False)
    AcceleratorState._reset_state(reset_partial_state=True)
    w, losses, _ = _train(Accelerator(cpu=True), watched, _batches(STEPS), watched=True)
    assert [r.step for r in w.records] == list(range(STEPS))
    assert [r.loss for r in w.records] == pytest.approx(losses, rel=1e-6)
    assert all(r.scale is None and r.micro_batches == 1 for r in w.records)
    for (name, a), b in zip(plain.state_dict().items(), watched.state_dict().values()):
        assert torch.equal(a, b), name


def test_micro_batches_of_accumulate_belong_to_the_step_they_feed():
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    w, losses, _ = _train(acc, _net(), _batches(2 * 3), watched=True, log_loss=True)
    # AcceleratedOptimizer.step() is a no-op until the gradients sync: one record per 2 batches
    assert [r.micro_batches for r in w.records] == [2, 2, 2]
    expected = [(losses[2 * i] + losses[2 * i + 1]) / 2 for i in range(3)]
    assert [r.loss for r in w.records] == pytest.approx(expected, rel=1e-6)
    # without log_loss: the sum of what accelerator.backward started from (each loss / 2)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    w, _, _ = _train(acc, _net(), _batches(2 * 3), watched=True)
    assert [r.loss for r in w.records] == pytest.approx(expected, rel=1e-6)


def test_accelerators_scaler_skip_is_recorded_as_accelerate_itself_reports_it():
    # On CPU Accelerate makes no GradScaler (fp16 there is neither scaled nor autocast), so this
    # gives it one, as it makes on CUDA: its backward scales, its optimizer steps through it.
    acc = Accelerator(cpu=True)
    assert acc.scaler is None
    acc.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)  # no overflow but the planted
    w, losses, skipped = _train(acc, _net(at=K), _batches(STEPS), watched=True, autocast=True)
    scales = [r.scale for r in w.records]
    assert skipped == [s == K for s in range(STEPS)]  # accelerate's own optimizer_step_was_skipped
    assert [r.skipped for r in w.records] == skipped
    assert scales[K + 1] == scales[K] * acc.scaler.get_backoff_factor()
    bad = w.records[K]
    assert bad.nonfinite and bad.first_module == "2" and bad.first_phase == "forward"
    assert not math.isfinite(losses[K]) and not math.isfinite(bad.loss)
    assert [r.loss for r in w.records if r.step != K] == \
        pytest.approx([v for s, v in enumerate(losses) if s != K], rel=1e-6)
