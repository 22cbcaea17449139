"""--show-code: the code it prints, run as plain torch, gives what the %%amp cell gave."""

from __future__ import annotations

import pytest
import torch
from _magics_kit import amp as _amp
from _magics_kit import shell_with_ampnb

from ampnb.device import restore_tf32, tf32_state
from ampnb.modes import get_mode
from ampnb.recipe_cell import backward_outside_autocast

MODES = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")

NET = """net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
net.load_state_dict(start)  # born in the default dtype: bf16 under bf16-true
xs = x.to(torch.get_default_dtype())
opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
losses = []
"""
CELLS = {
    "loop": NET + """for _ in range(3):
    loss = torch.nn.functional.mse_loss(net(xs).float(), t)
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.detach())
y = net(xs)
""",
    # forward and backward in one statement: the forward must stay under autocast
    "one line": NET + """for _ in range(3):
    torch.nn.functional.mse_loss(net(xs).float(), t).backward(); opt.step()
    g, = torch.autograd.grad(net(xs).float().square().sum(), [net[0].weight])
    opt.zero_grad()
    losses.append(g)
y = net(xs)
""",
}


@pytest.fixture
def ip():
    yield from shell_with_ampnb()


def _start() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    shapes = {"0.weight": (32, 16), "0.bias": (32,), "2.weight": (4, 32), "2.bias": (4,)}
    return {k: torch.randn(*s, generator=g) / 4 for k, s in shapes.items()}


def _run_shown(code: str, ns: dict) -> dict:
    flags = tf32_state()
    try:  # the shown code sets the global TF32 flags itself, as a user's would
        exec(compile(code, "<show-code>", "exec"), ns)
    finally:
        restore_tf32(flags)
    return ns


@pytest.mark.parametrize("cell", CELLS)
@pytest.mark.parametrize("mode", MODES)
def test_the_shown_code_trains_to_the_same_weights(ip, mode, cell):
    """A small training loop in the cell: the shown code, run as written, ends bit-identical."""
    start, t = _start(), torch.randn(4, 4, generator=torch.Generator().manual_seed(2))
    ip.user_ns.update(start=start, t=t)
    # fp16 products in torch's own CPU kernels in both, so that plain torch can match them
    _amp(ip, f"{mode} --fp16-kernels native --show-code -o r", CELLS[cell])
    code = ip.user_ns["r"].code
    ns = _run_shown(code, {"torch": torch, "x": ip.user_ns["x"], "start": start, "t": t})
    assert ns["y"].dtype == ip.user_ns["y"].dtype
    assert torch.equal(ns["y"], ip.user_ns["y"])
    for got, want in zip(ns["losses"], ip.user_ns["losses"], strict=True):
        assert torch.equal(got, want)
    for got, want in zip(ns["net"].parameters(), ip.user_ns["net"].parameters(), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    if get_mode(mode).is_mixed:
        assert "with torch.autocast(device_type=\"cpu\", enabled=False):" in code
        assert "cache_enabled=False" in code


def test_a_grad_scaler_loop_in_a_16_mixed_cell(ip):
    ip.user_ns.update(start=_start(), t=torch.randn(4, 4, generator=torch.Generator().manual_seed(2)))
    cell = NET + """scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 20)
for _ in range(3):
    loss = torch.nn.functional.mse_loss(net(xs).float(), t)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    losses.append(loss.detach())
y = net(xs)
"""
    _amp(ip, "16-mixed --fp16-kernels native --show-code -o r", cell)
    code = ip.user_ns["r"].code
    assert "    scaler.scale(loss).backward()\n" in code  # kept as written, under autocast off
    ns = _run_shown(code, {"torch": torch, "x": ip.user_ns["x"], "start": ip.user_ns["start"],
                           "t": ip.user_ns["t"]})
    assert torch.equal(ns["y"], ip.user_ns["y"])
    assert ns["scaler"].get_scale() == ip.user_ns["scaler"].get_scale()


def test_backward_statements_are_placed_outside_autocast():
    cell = ("a = 1  # kept\n"
            "loss_fn(model(x), y).backward()\n"
            "for i in range(2): loss = f(x); loss.backward()\n")
    code, found = backward_outside_autocast(cell, '"cpu"')
    assert found
    # a line with several statements: the cell is rewritten one statement per line
    assert code.splitlines() == [
        "a = 1",
        "_loss = loss_fn(model(x), y)",
        'with torch.autocast(device_type="cpu", enabled=False):  # backward outside autocast, '
        "as in torch's recipe",
        "    _loss.backward()",
        "for i in range(2):",
        "    loss = f(x)",
        '    with torch.autocast(device_type="cpu", enabled=False):  # backward outside autocast, '
        "as in torch's recipe",
        "        loss.backward()",
    ]
    kept = backward_outside_autocast("y = f(x)  # a comment\nloss.backward()  # go\n", '"cpu"')[0]
    assert kept.splitlines()[0] == "y = f(x)  # a comment" and "loss.backward()  # go" in kept
    assert backward_outside_autocast("y = f(x)\n", '"cpu"') == ("y = f(x)\n", False)
    assert backward_outside_autocast("%time y = f(x)", '"cpu"') is None  # IPython syntax
