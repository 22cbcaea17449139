"""close() puts everything back: hooks, the scaler's methods, autograd's engine call; also when
the loop raises or is interrupted at any line of ampnb's; and the model is no longer held."""

from __future__ import annotations

import copy
import gc
import os
import weakref

import pytest
import torch
from _sweep import sweep
from torch import nn
from watch_models import Planted, batches, run

import ampnb
from ampnb import _interrupt, putback_state

BUDGET = int(os.environ.get("AMPNB_SWEEP_BUDGET", "60")) or 10**9


def _world():
    m = Planted()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sc = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    return m, opt, sc


def _hooks(m, opt, sc):
    """Everything the watch may add, as it stands."""
    mods = [(dict(x._forward_hooks), dict(x._forward_pre_hooks)) for x in m.modules()]
    return (mods, dict(opt._optimizer_step_pre_hooks), dict(opt._optimizer_step_post_hooks),
            set(vars(sc)), putback_state.torch_state())


def test_close_removes_every_hook_replaces_no_method_and_is_idempotent():
    m, opt, sc = _world()
    before = _hooks(m, opt, sc)
    w = ampnb.watch(m, opt, sc, keep_overflow=None)
    assert _hooks(m, opt, sc) != before  # it did attach
    assert "update" not in vars(sc) and "scale" not in vars(sc)  # the user's objects as they are
    w.close()
    assert _hooks(m, opt, sc) == before
    w.close()
    assert _hooks(m, opt, sc) == before
    assert "closed" in repr(w)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_an_error_or_interrupt_in_the_loop_closes_the_watch(error):
    m, opt, sc = _world()
    before = _hooks(m, opt, sc)
    with pytest.raises(error):
        with ampnb.watch(m, opt, sc) as w:
            run(m, opt, batches(2), scaler=sc)
            raise error("in the user's loop")
    assert _hooks(m, opt, sc) == before
    assert len(w.records) == 2  # what was recorded stays


def test_the_watch_holds_no_reference_to_the_model_after_close():
    m, opt, sc = _world()
    w = run(m, opt, batches(2, blow_at=1), scaler=sc, watch={"every": 1})
    alive = weakref.ref(m), weakref.ref(opt), weakref.ref(sc)
    del m, opt, sc
    gc.collect()
    assert [r() for r in alive] == [None, None, None]
    assert len(w.records) == 2 and w.records[1].first_module == "blowup"


def test_a_copy_of_a_watched_model_carries_no_watch():
    m, opt, sc = _world()
    with ampnb.watch(m, opt, sc) as w:
        twin = copy.deepcopy(m)
        twin(torch.randn(2, 8)).sum().backward()  # not the watched model: no micro-batch
        run(m, opt, batches(1), scaler=sc)
    assert [r.micro_batches for r in w.records] == [1]
    for x in twin.modules():
        for h in x._forward_hooks.values():
            assert h(x, (), None) is None  # what is left does nothing


def test_a_backward_on_another_thread_is_not_counted():
    import threading

    m, opt, sc = _world()
    with ampnb.watch(m, opt) as w:
        other = nn.Linear(2, 1)
        t = threading.Thread(target=lambda: other(torch.ones(1, 2)).sum().backward())
        t.start()
        t.join()
        run(m, opt, batches(1))
    assert [r.micro_batches for r in w.records] == [1]


@pytest.mark.parametrize("every", [1, 2])  # 2: step 1's overflow is named by a rerun
def test_every_interrupt_during_a_watched_loop_reaches_the_caller_and_restores(every):
    def setup():
        world = _world()
        return world, _hooks(*world)

    def loop(state):
        (m, opt, sc), _ = state
        run(m, opt, batches(2, blow_at=1), scaler=sc, watch={"every": every})

    def check(state):
        world, before = state
        problems = ["the interrupt was still held after the run"] if _interrupt._pending else []
        _interrupt._pending.clear()
        after = _hooks(*world)
        return problems + [f"not restored: {k}" for k, (a, b) in enumerate(zip(before, after))
                           if a != b]

    tried, lost = sweep(setup, loop, check, BUDGET)
    assert tried > 10
    assert not lost, f"{len(lost)} of {tried} interrupts lost:\n" + "\n".join(lost[:10])
