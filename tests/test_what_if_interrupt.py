"""what_if under an interrupt at any function entry in any frame (torch's own included): the
model's hooks, gradients, weights and buffers, torch's state and the process's mode stacks,
autocast counter and SIGINT handler are all as before, and the interrupt reaches the caller."""

from __future__ import annotations

import os

import torch
from _sweep import changed, process_state, sweep
from torch import nn

import ampnb

BUDGET = int(os.environ.get("AMPNB_SWEEP_BUDGET", "60")) or 10**9


def _hooks(model: nn.Module) -> list:
    return [(dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m._backward_hooks))
            for m in model.modules()]


def test_interrupt_at_any_function_entry_in_a_what_if_leaks_nothing():
    def setup():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 4))
        m[0].weight.grad = torch.ones_like(m[0].weight)  # a gradient of the user's, kept
        return {"m": m, "x": torch.randn(3, 8), "y": torch.randn(3, 4), "hooks": _hooks(m),
                "state": {k: v.clone() for k, v in m.state_dict().items()},
                "grads": [None if p.grad is None else p.grad.clone() for p in m.parameters()],
                "process": process_state()}

    def run(w):
        ampnb.what_if(w["m"], (w["x"], w["y"]), nn.functional.mse_loss,
                      formats=["bf16", "fp8_e4m3_tensorwise", "mxfp4", "nvfp4"])

    def check(w):
        m, problems = w["m"], changed(w["process"], process_state())
        if _hooks(m) != w["hooks"]:
            problems.append("what_if's hooks are still on the model")
        if any(not torch.equal(v, w["state"][k]) for k, v in m.state_dict().items()):
            problems.append("weights or buffers changed")
        grads = [p.grad for p in m.parameters()]
        if any((a is None) != (b is None) or (a is not None and not torch.equal(a, b))
               for a, b in zip(grads, w["grads"])):
            problems.append("gradients changed")
        return problems

    tried, leaks = sweep(setup, run, check, BUDGET, events="calls")
    assert tried > 10
    assert not leaks, f"{len(leaks)} of {tried} interrupt points leaked:\n" + "\n".join(leaks[:10])


def _rows(**kw):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(3, 8, generator=g), torch.randn(3, 4, generator=g)
    return ampnb.what_if(m, (x, y), nn.functional.mse_loss, formats=["bf16", "mxfp4"]).rows


def test_what_if_inside_a_users_mode_and_in_a_worker_thread_gives_the_same_rows():
    import threading

    from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

    class Counting(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Counting.calls += 1
            return func(*args, **(kwargs or {}))

    alone = _rows()
    with Counting() as mode:
        inside = _rows()
        assert _get_current_function_mode_stack() == [mode]
    assert Counting.calls > 0 and _get_current_function_mode_stack() == []
    box = []
    worker = threading.Thread(target=lambda: box.append(_rows()))
    worker.start()
    worker.join()
    assert inside == alone and box == [alone]
