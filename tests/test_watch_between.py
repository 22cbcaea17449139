"""Between statistics steps no module is hooked and nothing the user computes runs again: a
non-finite step there is recorded without naming its module, and training (RNG, buffers,
attributes) goes exactly as unwatched; statistics steps name it from the step itself."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from watch_models import Blowup, Planted, batches, run

import ampnb


class Stateful(nn.Module):
    """Linear -> BatchNorm -> Blowup -> Dropout -> Linear, counting its forwards in an attribute:
    state that a second forward would change (running statistics, RNG, a counter)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)
        self.blowup = Blowup()
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(16, 4)
        self.forwards = 0

    def forward(self, x: torch.Tensor, blow: bool = False) -> torch.Tensor:
        self.forwards += 1
        return self.fc2(self.drop(self.blowup(self.norm(self.fc1(x)), blow)))


def test_between_stats_steps_no_module_is_hooked():
    m = Planted()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    hooked = []
    probe = m.fc2.register_forward_pre_hook(
        lambda mod, args: hooked.append(len(m.fc1._forward_hooks)))
    run(m, opt, batches(4), watch={"every": 3})
    probe.remove()
    # fc1, a child the loop could call directly, always has the watch's entry hook; the
    # statistics hook is there on steps 0 and 3 only
    assert hooked == [2, 1, 1, 2]


@pytest.mark.parametrize("scaled", [True, False])
def test_a_forward_overflow_is_named_on_statistics_steps_and_only_recorded_between(scaled):
    names = {}
    for every in (1, 50):
        m = Planted()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if scaled else None
        w = run(m, opt, batches(5, blow_at=3, micro=2), scaler=scaler, watch={"every": every})
        bad = w.records[3]
        assert bad.nonfinite and bad.skipped == scaled
        names[every] = (bad.first_module, bad.first_phase)
        assert not any(r.nonfinite for r in w.records[:3])  # unscaled, NaN weights follow
    assert names == {1: ("blowup", "forward"), 50: ("", "")}


def test_between_statistics_steps_training_goes_exactly_as_unwatched():
    got = {}
    for watched in (False, True):
        m = Stateful()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        w = run(m, opt, batches(6, blow_at=2), scaler=scaler,
                watch={"every": 50} if watched else None)
        got[watched] = (m, torch.get_rng_state(), w)
    (m0, rng0, _), (m1, rng1, w) = got[False], got[True]
    assert w.records[2].skipped and w.records[2].first_module == ""
    assert torch.equal(rng0, rng1)
    assert m0.forwards == m1.forwards == 6
    for (n, a), b in zip(m0.state_dict().items(), m1.state_dict().values()):
        assert torch.equal(a, b), n


class Wrapper(nn.Module):
    """What a LightningModule is to its model: the loop calls the child, never the wrapper."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Planted()


@pytest.mark.parametrize("every", [1, 50])
def test_a_loop_that_calls_a_child_of_the_watched_module_is_recorded(every, tmp_path):
    wrapper = Wrapper()
    opt = torch.optim.AdamW(wrapper.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    steps = batches(5, blow_at=3, micro=2)
    w = ampnb.watch(wrapper, opt, scaler, every=every, keep_overflow=tmp_path)
    with w:
        run(wrapper.model, opt, steps, scaler=scaler)
    assert [r.micro_batches for r in w.records] == [2] * 5
    assert all(math.isfinite(r.loss) for k, r in enumerate(w.records) if k != 3)
    bad = w.records[3]
    named = ("model.blowup", "forward") if every == 1 else ("", "")
    assert bad.skipped and (bad.first_module, bad.first_phase) == named
    assert not any(r.nonfinite for k, r in enumerate(w.records) if k != 3)
    replayed = ampnb.diagnosis.replay(tmp_path, Wrapper())
    assert replayed.micro_batch == 0 and replayed.nonfinite.phase == "forward"
    assert replayed.nonfinite.module == "blowup"  # named within the module the loop called


def test_a_forward_interrupted_by_the_user_does_not_hide_the_next_one():
    """torch runs no forward hook after a KeyboardInterrupt, so the entry's end is never seen:
    the next forward is still a step's, and its overflow is named."""

    class Stop(nn.Module):
        armed = False

        def forward(self, x):
            if self.armed:
                raise KeyboardInterrupt
            return x

    for watched_is_wrapper in (False, True):  # the loop calls the watched module / its child
        wrapper = Wrapper()
        wrapper.model.act = Stop()
        opt = torch.optim.SGD(wrapper.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        w = ampnb.watch(wrapper if watched_is_wrapper else wrapper.model, opt, scaler)
        for step, blow in enumerate((False, True)):
            if step == 1:
                wrapper.model.act.armed = True
                with pytest.raises(KeyboardInterrupt):
                    wrapper.model(torch.randn(4, 8))
                wrapper.model.act.armed = False
            with torch.autocast("cpu", dtype=torch.float16):
                loss = wrapper.model(torch.randn(4, 8), blow=blow).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        w.close()
        bad = w.records[1]
        assert bad.skipped and bad.first_phase == "forward" and bad.micro_batches == 1
        assert bad.first_module == ("model.blowup" if watched_is_wrapper else "blowup")
