"""An interrupt that lands where torch's optimizer step puts grad mode back, in a watched loop.

torch's `_use_grad` (every built-in optimizer's step) and `@torch.no_grad()` (LBFGS) restore
grad mode in a `finally` / `__exit__` that calls Python functions: `graph_break()`, then
`set_grad_enabled(prev)`. A SIGINT at one of those entries leaves grad mode off for every later
cell. Inside a watch, the step holds it there and raises it once grad mode is back.
"""

from __future__ import annotations

import signal
import sys
from typing import Any

import pytest
import torch

import ampnb
from ampnb import putback_state


class _At:
    """Deliver SIGINT (through the installed handler) at the n-th entry of a function named
    `name` whose caller is named `caller`: what a real interrupt there would do."""

    def __init__(self, name: str, caller: str, n: int) -> None:
        self.name, self.caller, self.n, self.fired = name, caller, n, False

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call" or frame.f_code.co_name != self.name \
                or frame.f_back is None or frame.f_back.f_code.co_name != self.caller:
            return
        self.n -= 1
        if self.n == 0:
            sys.setprofile(None)
            self.fired = True
            signal.getsignal(signal.SIGINT)(signal.SIGINT, frame)


def _loop(model: torch.nn.Module, opt: torch.optim.Optimizer, closure: bool) -> None:
    for _ in range(2):
        def loss() -> torch.Tensor:
            opt.zero_grad()
            out = model(torch.randn(2, 8)).sum()
            out.backward()
            return out
        if closure:
            opt.step(loss)
        else:
            loss()
            opt.step()


# (optimizer, where the restore calls a Python function, its caller, which such entry): the
# second `graph_break` in `_use_grad` and the `set_grad_enabled` after it are its `finally`;
# LBFGS's `no_grad.__exit__` sets grad mode back through `set_grad_enabled.__init__`.
CASES = {
    "sgd-graph_break": (torch.optim.SGD, "graph_break", "_use_grad", 2, False),
    "sgd-set_grad_enabled": (torch.optim.SGD, "__init__", "_use_grad", 2, False),
    "adamw-graph_break": (torch.optim.AdamW, "graph_break", "_use_grad", 2, False),
    "lbfgs-no_grad-exit": (torch.optim.LBFGS, "__init__", "__exit__", 1, True),
}


@pytest.mark.parametrize("case", CASES)
def test_an_interrupt_where_the_step_puts_grad_mode_back_leaves_grad_mode_on(case):
    opt_cls, name, caller, n, closure = CASES[case]
    model = torch.nn.Linear(8, 1)
    opt = opt_cls(model.parameters(), lr=0.1)
    before = putback_state.torch_state()
    at = _At(name, caller, n)
    with pytest.raises(KeyboardInterrupt):
        with ampnb.watch(model, opt) as w:
            sys.setprofile(at)
            try:
                _loop(model, opt, closure)
            finally:
                sys.setprofile(None)
    assert at.fired, f"no {name} called from {caller} in the step: torch changed"
    try:
        assert torch.is_grad_enabled(), "the interrupted step left grad mode off"
        assert putback_state.torch_state() == before
    finally:
        torch.set_grad_enabled(True)
    assert len(w.records) <= 1  # raised at the end of the step it landed in, not later
    model(torch.randn(2, 8)).sum().backward()  # the next cell trains


def test_the_step_body_itself_is_not_held():
    """An interrupt inside the optimizer's own update is raised there, at once."""
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    at = _At("_single_tensor_sgd", "sgd", 1)
    with pytest.raises(KeyboardInterrupt) as got:
        with ampnb.watch(model, opt):
            sys.setprofile(at)
            try:
                _loop(model, opt, False)
            finally:
                sys.setprofile(None)
    assert at.fired
    assert got.traceback[-1].name != "ended"  # not raised after the step by the watch
    assert torch.is_grad_enabled()
