"""Backwards seen through torch's public TorchFunctionMode (`ampnb.backwards`): a `%%amp` cell's
backward runs outside autocast, watches see their roots, nothing in torch is replaced, and the
mode is off the stack wherever a forward or an optimizer step runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils.checkpoint import checkpoint
from watch_models import batches, run

import ampnb
from ampnb import backwards, putback_state
from ampnb.step import backward_outside_autocast
from tests._magics_kit import amp, shell_with_ampnb

ip = pytest.fixture(shell_with_ampnb)
PACKAGE = Path(ampnb.__file__).parent


def test_nothing_in_torch_or_the_users_objects_is_replaced():
    """The engine call, the scaler's private per-optimizer state, methods put on user objects."""
    private = re.compile(r"_engine_run_backward|_per_optimizer_states|_execution_engine\s*=(?!=)")
    replaced = re.compile(r"^\s*(scaler|sc|optimizer|opt|model)\.\w+\s*=(?!=)", re.M)
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        assert not private.search(text), path
        assert not replaced.search(text), path


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


@pytest.mark.parametrize("call", ["tensor", "autograd.backward", "autograd.grad"])
def test_every_backward_spelling_runs_outside_autocast(call):
    x = torch.randn(3, requires_grad=True)
    start = putback_state.torch_state()
    _Seen.on = []
    with backward_outside_autocast(), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = _Seen.apply(x).sum()
        {"tensor": lambda: loss.backward(),
         "autograd.backward": lambda: torch.autograd.backward([loss]),
         "autograd.grad": lambda: torch.autograd.grad(loss, [x])}[call]()
        assert torch.is_autocast_enabled("cpu")  # back on after the backward
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the reference: autocast reaches backward
        _Seen.apply(x).sum().backward()
    assert _Seen.on == [False, True]
    assert putback_state.torch_state() == start


def test_the_mode_leaves_the_stack_when_the_body_raises_and_a_users_mode_is_kept():
    class Mine(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    start = putback_state.torch_state()
    with Mine() as mine:
        with pytest.raises(ZeroDivisionError), backward_outside_autocast():
            assert len(_get_current_function_mode_stack()) == 2
            _ = 1 / 0
        assert _get_current_function_mode_stack() == [mine]
    assert putback_state.torch_state() == start


class _Looks(nn.Module):
    """Notes the torch-function modes on the stack while its forward runs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.stacks: list[int] = []

    def forward(self, x):
        self.stacks.append(len(_get_current_function_mode_stack()))
        return self.lin(x)


def _loop(model, opt, n=2):
    for _ in range(n):
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()


def test_no_forward_or_step_runs_under_the_mode_in_a_cell_or_a_watch(ip):
    """Where nearly every op runs the mode costs each a Python call: it is suspended there."""
    m = _Looks()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    steps: list[int] = []
    look = opt.register_step_pre_hook(  # runs after the cell's global hooks
        lambda *_: steps.append(len(_get_current_function_mode_stack())))
    ip.user_ns.update(m=m, opt=opt, loop=_loop)
    amp(ip, "bf16-mixed", "loop(m, opt)\n")
    look.remove()
    with ampnb.watch(m, opt) as w:
        look = opt.register_step_pre_hook(  # after the watch's own
            lambda *_: steps.append(len(_get_current_function_mode_stack())))
        _loop(m, opt)
    look.remove()
    assert m.stacks == [0] * 4 and steps == [0] * 4
    assert [r.micro_batches for r in w.records] == [1, 1]
    assert len(_get_current_function_mode_stack()) == 0


def test_a_reentrant_checkpoints_inner_backward_is_not_a_micro_batch():
    class Ckpt(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)

        def forward(self, x):
            return self.b(checkpoint(self.a, x, use_reentrant=True))

    m = Ckpt()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with ampnb.watch(m, opt) as w:
        for _ in range(2):
            opt.zero_grad()
            loss = m(torch.randn(2, 4, requires_grad=True)).sum()
            loss.backward()
            opt.step()
    assert [r.micro_batches for r in w.records] == [1, 1]
    assert w.records[-1].loss == pytest.approx(float(loss))


class _Stops(nn.Module):
    """Raises KeyboardInterrupt in its forward once: torch skips the forward's end hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.stop = True

    def forward(self, x):
        if self.stop:
            self.stop = False
            raise KeyboardInterrupt
        return self.lin(x)


def test_a_forward_cut_by_an_interrupt_leaves_the_watch_seeing_the_next_backward():
    m = _Stops()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with ampnb.watch(m, opt) as w:
        with pytest.raises(KeyboardInterrupt):
            m(torch.randn(2, 4))
        _loop(m, opt)
    assert [r.micro_batches for r in w.records] == [1, 1]
    assert all(r.loss == r.loss for r in w.records)
    assert len(_get_current_function_mode_stack()) == 0


def test_a_watch_in_a_cell_with_a_watched_loop_counts_each_backward_once(ip):
    from watch_models import Planted

    m = Planted()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    ip.user_ns.update(m=m, opt=opt, run=run, steps=batches(3, micro=2))
    amp(ip, "bf16-mixed", "w = run(m, opt, steps, dtype=torch.bfloat16, watch={})\n")
    w = ip.user_ns.pop("w")
    assert [r.micro_batches for r in w.records] == [2, 2, 2]
    assert len(_get_current_function_mode_stack()) == 0


def test_a_step_given_a_closure_still_sees_the_backward_inside_it(ip):
    """Lightning's automatic optimization (and LBFGS) run forward and backward inside the step."""
    torch.manual_seed(0)
    m, x = nn.Linear(4, 1), torch.randn(8, 4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    losses = []

    def closure():
        opt.zero_grad()
        loss = _Seen.apply(m(x)).pow(2).mean()
        loss.backward()
        losses.append(float(loss))
        return loss

    with ampnb.watch(m, opt) as w:
        for _ in range(2):
            opt.step(closure)
    assert [r.micro_batches for r in w.records] == [1, 1]
    assert [r.loss for r in w.records] == pytest.approx(losses)
    _Seen.on = []
    ip.user_ns.update(opt=opt, closure=closure)
    amp(ip, "bf16-mixed", "opt.step(closure)\n")
    assert _Seen.on == [False]  # the cell's backward inside the step ran outside autocast


def test_a_step_that_raised_leaves_the_watch_seeing_the_next_backward():
    """An exception in optimizer.step skips its post hooks: the next forward puts the mode back."""
    m = nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with ampnb.watch(m, opt) as w:
        fail = opt.register_step_pre_hook(lambda *_: 1 / 0)  # after the watch's own
        opt.zero_grad()
        m(torch.randn(2, 4)).sum().backward()
        with pytest.raises(ZeroDivisionError):
            opt.step()
        fail.remove()
        _loop(m, opt)
    assert [r.micro_batches for r in w.records][-2:] == [1, 1]
    assert len(_get_current_function_mode_stack()) == 0


def test_an_interrupt_at_any_line_of_a_seen_backward_leaves_nothing_set():
    """Every line ampnb runs around a cell's and a watch's backward, interrupted in turn: the
    'a backward runs' flag, the held mode, autocast and the mode stack are all as before."""
    from _sweep import sweep

    def setup():
        m = nn.Linear(4, 1)
        return {"m": m, "opt": torch.optim.SGD(m.parameters(), lr=0.1),
                "before": putback_state.torch_state()}

    def run(w):
        with ampnb.watch(w["m"], w["opt"]), backward_outside_autocast(), \
                torch.autocast("cpu", dtype=torch.bfloat16):
            w["m"](torch.randn(2, 4)).float().sum().backward()
            w["opt"].step()

    def check(w):
        problems = []
        if backwards._here.inside or backwards._here.held is not None:
            problems.append("a backward left marked running, or the mode held aside")
        if putback_state.torch_state() != w["before"]:
            problems.append("torch state changed")
        return problems

    tried, leaks = sweep(setup, run, check, 10**9)
    assert tried > 50
    assert not leaks, f"{len(leaks)} of {tried} leaked:\n" + "\n".join(leaks[:5])
