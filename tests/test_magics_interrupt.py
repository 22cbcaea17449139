"""An interrupt at any line of %%amp's own set-up and restore leaves the state of a clean run."""

from __future__ import annotations

import copy
import os
import signal
import sys

import pytest
import torch
from _magics_kit import shell_with_ampnb

import ampnb
from ampnb import _interrupt, putback_state

# The lines swept: %%amp's and compare's own files (the cell itself is interrupted elsewhere).
MINE = tuple(os.path.join(os.path.dirname(ampnb.__file__), d) for d in ("magics", "comparison"))
SETUP = """\
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
def train_step():
    opt.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    return loss
"""


@pytest.fixture
def ip():
    yield from shell_with_ampnb()


class _InterruptAt:
    """A tracer that interrupts at the n-th line run in MINE, as SIGINT would (held if deferred)."""

    def __init__(self, n: int | None) -> None:
        self.n, self.lines, self.fired = n, 0, False

    def __call__(self, frame, event, arg):
        if not frame.f_code.co_filename.startswith(MINE):
            return None
        return self._line

    def _line(self, frame, event, arg):
        if event == "line":
            self.lines += 1
            if self.lines == self.n:
                self.fired = True
                if _interrupt.deferring():
                    _interrupt._hold(signal.SIGINT, frame)
                else:
                    raise KeyboardInterrupt
        return self._line


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _sweep(ip, line: str, cell: str) -> None:
    assert ip.run_cell(SETUP).success
    ns = ip.user_ns
    model, opt = ns["model"], ns["opt"]
    ip.run_cell("train_step()")  # momentum buffers exist: there is optimizer state to keep
    weights, state = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    names, before = set(ns), putback_state.torch_state()

    def run(n):
        tracer = _InterruptAt(n)
        sys.settrace(tracer)
        try:
            ip.run_cell_magic("amp", line + " -q", cell)
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        return tracer

    run(None)  # warm: what is read once per process (support notes, kernel handles) is read
    total = run(None).lines
    clean = {k: v.clone() for k, v in model.state_dict().items()}
    step = max(1, total // 40)
    for n in [*range(1, total + 1, step), total]:
        tracer = run(n)
        assert tracer.fired
        assert putback_state.torch_state() == before, n
        now = model.state_dict()
        if "--compare" in line:  # compare leaves everything as before the cell
            assert all(torch.equal(now[k], weights[k]) for k in weights), n
            assert _same(opt.state_dict(), state) and set(ns) == names, n
        else:  # a single run either ran the step or not; never half-converted
            assert all(now[k].dtype == weights[k].dtype for k in weights), n
        for k in weights:  # the next cell starts from a clean state again
            with torch.no_grad():
                now[k].copy_(clean[k] if "--compare" not in line else weights[k])
    assert _interrupt._pending == []


def test_interrupt_anywhere_in_compare(ip):
    _sweep(ip, "--compare bf16-true,bf16-mixed -r 1 --tf32 emulate", "train_step()")


def test_interrupt_anywhere_in_a_single_run(ip):
    _sweep(ip, "bf16-true --tf32 emulate --memory --hunt --trace", "train_step()")
