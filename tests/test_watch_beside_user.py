"""The watch and a `%%amp` cell beside the user's own torch modes, threads, optimizers and
models (issue 41): what each counts comes from its own model and optimizer, never from the order
of the user's modes or the thread that runs the loop; a failure in its hooks never ends a step."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

import ampnb
from ampnb import putback_state
from tests._magics_kit import amp, shell_with_ampnb

ip = pytest.fixture(shell_with_ampnb)


class _Seen(torch.autograd.Function):
    """Identity whose backward notes whether autocast was on while it ran."""

    on: list[bool] = []

    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, g):
        _Seen.on.append(torch.is_autocast_enabled("cpu"))
        return g


class FnMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class DispMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _debug_mode():
    from torch.utils._debug_mode import DebugMode

    return DebugMode()


MODES = {"function": FnMode, "dispatch": DispMode,
         "flop_counter": lambda: FlopCounterMode(display=False), "debug": _debug_mode}


def _no_stray_mode() -> None:
    assert _get_current_function_mode_stack() == []
    assert _get_current_dispatch_mode_stack() == []


def _profiled(model: nn.Module, make) -> None:
    """A forward pre-hook enters a fresh mode and a forward hook exits it (profilers' pattern)."""
    live: list = []

    def enter(*_):
        live.append(make())
        live[-1].__enter__()

    def leave(*_):
        live.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave)


def _losses(model, opt, xs, *, backward=lambda loss: loss.backward()):
    out = []
    for x in xs:
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        backward(loss)
        opt.step()
        out.append(float(loss))
    return out


def _xs(n=3):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4, 8, generator=g) for _ in range(n)]


def _model(seed=0):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    return m, torch.optim.SGD(m.parameters(), lr=0.01)


# ----- defect 1: the user's modes --------------------------------------------------------------


def test_a_users_mode_entered_before_a_cell_and_exited_inside_it(ip):
    mine = FnMode()
    mine.__enter__()
    _Seen.on = []
    ip.user_ns.update(mine=mine, S=_Seen)
    amp(ip, "bf16-mixed", "mine.__exit__(None, None, None)\n"
                          "S.apply(lin(x)).float().sum().backward()\n")
    _no_stray_mode()
    assert _Seen.on == [False]  # the cell's backward after the user's exit: autocast off


@pytest.mark.parametrize("kind", list(MODES))
def test_a_mode_entered_and_left_by_forward_hooks_in_a_cell(ip, kind):
    lin = nn.Linear(16, 8)
    _profiled(lin, MODES[kind])
    _Seen.on = []
    ip.user_ns.update(m=lin, S=_Seen)
    amp(ip, "bf16-mixed", "for _ in range(2):\n    S.apply(m(x)).float().sum().backward()\n")
    _no_stray_mode()
    assert _Seen.on == [False, False]


@pytest.mark.parametrize("kind", list(MODES))
def test_a_mode_entered_and_left_by_forward_hooks_around_a_watched_loop(kind):
    m, opt = _model()
    _profiled(m, MODES[kind])
    with ampnb.watch(m, opt) as w:
        losses = _losses(m, opt, _xs())
    _no_stray_mode()
    assert [r.micro_batches for r in w.records] == [1, 1, 1]
    assert [r.loss for r in w.records] == pytest.approx(losses)


def test_a_users_mode_entered_before_a_watch_and_left_during_its_loop():
    m, opt = _model()
    mine = FnMode()
    mine.__enter__()
    with ampnb.watch(m, opt) as w:
        losses = _losses(m, opt, _xs(1))
        mine.__exit__(None, None, None)
        losses += _losses(m, opt, _xs(2))
    _no_stray_mode()
    assert [r.micro_batches for r in w.records] == [1, 1, 1]
    assert [r.loss for r in w.records] == pytest.approx(losses)


# ----- defect 2: threads ------------------------------------------------------------------------


def test_a_watch_opened_in_the_main_thread_sees_a_loop_in_a_worker_thread():
    m, opt = _model()
    losses: list[float] = []
    with ampnb.watch(m, opt) as w:
        t = threading.Thread(target=lambda: losses.extend(_losses(m, opt, _xs())))
        t.start()
        t.join()
    assert [r.micro_batches for r in w.records] == [1, 1, 1]
    assert [r.loss for r in w.records] == pytest.approx(losses)
    _no_stray_mode()


# ----- defect 4: what a step is ----------------------------------------------------------------


def test_two_backwards_on_one_forward_both_count_in_the_loss():
    m, opt = _model()
    with ampnb.watch(m, opt) as w:
        opt.zero_grad()
        out = m(_xs(1)[0])
        a, b = out.pow(2).mean(), out.abs().mean()
        a.backward(retain_graph=True)
        b.backward()
        opt.step()
    assert w.records[0].loss == pytest.approx(float(a) + float(b))


@pytest.mark.parametrize("shape", [(), (1,)])
def test_backward_roots_of_shape_empty_and_one(shape):
    m, opt = _model()
    with ampnb.watch(m, opt) as w:
        losses = _losses(m, opt, _xs(2), backward=lambda loss: loss.reshape(shape).backward())
    assert [r.loss for r in w.records] == pytest.approx(losses)


def test_lbfgs_with_a_closure_gives_one_record_per_step():
    m, _ = _model()
    opt = torch.optim.LBFGS(m.parameters(), lr=0.1, max_iter=4)
    x = _xs(1)[0]
    first: list[float] = []

    def closure():
        opt.zero_grad()
        loss = m(x).pow(2).mean()
        loss.backward()
        return loss

    with ampnb.watch(m, opt) as w:
        for _ in range(3):
            first.append(float(opt.step(closure)))
    assert len(w.records) == 3
    assert [r.loss for r in w.records] == pytest.approx(first)  # the loss step() returns


def test_a_gan_with_a_watch_on_each_model_counts_only_its_own():
    torch.manual_seed(0)
    G, D = nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 1))
    og, od = torch.optim.SGD(G.parameters(), lr=0.01), torch.optim.SGD(D.parameters(), lr=0.01)
    real = torch.randn(6, 8)
    g_losses, d_losses = [], []
    with ampnb.watch(G, og) as wg, ampnb.watch(D, od) as wd:
        for _ in range(4):
            od.zero_grad()
            fake = G(torch.randn(6, 4))
            d_real = D(real).pow(2).mean()
            d_real.backward()
            d_fake = (D(fake.detach()) - 1).pow(2).mean()
            d_fake.backward()
            od.step()
            d_losses.append(float(d_real) + float(d_fake))
            og.zero_grad()
            g = D(fake).abs().mean()
            g.backward()
            og.step()
            g_losses.append(float(g))
    assert len(wg.records) == 4 and len(wd.records) == 4
    assert [r.loss for r in wg.records] == pytest.approx(g_losses)
    assert [r.loss for r in wd.records] == pytest.approx(d_losses)


def test_a_caught_step_error_and_a_failed_backward_are_not_counted():
    m, opt = _model()

    class Fails(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("backward failed")

    xs = _xs(3)
    with ampnb.watch(m, opt) as w:
        opt.zero_grad()
        with pytest.raises(RuntimeError, match="backward failed"):  # after reaching m's output
            m(Fails.apply(xs[0].requires_grad_())).sum().backward()
        fail = opt.register_step_pre_hook(lambda *_: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            opt.step()
        fail.remove()
        losses = _losses(m, opt, xs[1:])
    assert [r.micro_batches for r in w.records] == [1, 1]
    assert [r.loss for r in w.records] == pytest.approx(losses)


def test_gradients_zeroed_without_a_step_are_not_a_completed_step():
    m, opt = _model()
    xs = _xs(3)
    with ampnb.watch(m, opt) as w:
        m(xs[0]).sum().backward()
        opt.zero_grad()  # thrown away: no step
        losses = _losses(m, opt, xs[1:])
    assert [r.loss for r in w.records] == pytest.approx(losses)
    assert not any(r.skipped for r in w.records)


class _Ckpt(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.pre, self.head = nn.Linear(8, 8), nn.Linear(8, 1)
        self.blk = nn.Sequential(nn.Linear(8, 8), nn.ReLU())

    def forward(self, x):
        return self.head(checkpoint(self.blk, self.pre(x), use_reentrant=self.reentrant))


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpointed_overflow_is_named_at_the_layer_inside(reentrant):
    torch.manual_seed(0)
    m = _Ckpt(reentrant)
    with torch.no_grad():
        m.pre.weight.fill_(1.0)
        m.pre.bias.zero_()
        m.blk[0].weight.fill_(1e38)  # its output overflows fp32: inf
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    with ampnb.watch(m, opt) as w:
        opt.zero_grad()
        m(torch.ones(2, 8)).sum().backward()
        opt.step()
    assert w.records[0].nonfinite and w.records[0].first_module == "blk.0"


# ----- an instrument never raises into training -------------------------------------------------


@pytest.mark.parametrize("where", ["after_backward", "on_output", "read_grads"])
def test_a_failure_in_the_watchs_hooks_is_one_warning_and_the_step_goes_on(monkeypatch, where):
    from ampnb.watcher.hooks import StepState

    def broken(*_, **__):
        raise RuntimeError("injected")

    m, opt = _model()
    ref, ref_opt = _model()
    expected = _losses(ref, ref_opt, _xs())
    monkeypatch.setattr(StepState, where, broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ampnb.watch(m, opt) as w:
            losses = _losses(m, opt, _xs())
    assert losses == expected  # the user's steps went on, untouched
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), ref.parameters()))
    mine = [c for c in caught if "ampnb.watch" in str(c.message)]
    assert len(mine) == 1 and "injected" in str(mine[0].message)
    assert len(w.records) == 3 and w.records[0].incomplete
    assert putback_state.torch_state() == putback_state.torch_state()
