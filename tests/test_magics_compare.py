"""%%amp --compare: every mode from the same saved start, true modes converted, failures per row."""

from __future__ import annotations

import copy
import random
import subprocess
import sys

import pytest
import torch
from _magics_kit import amp as _amp
from _magics_kit import shell_with_ampnb
from _magics_kit import shown as _shown
from IPython.core.error import UsageError

from ampnb import putback_state


@pytest.fixture
def ip():
    yield from shell_with_ampnb()

SETUP = """\
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
data = [(x, torch.tensor([0, 1, 2, 3]))]

def train_step():
    inputs, targets = data[0]
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(inputs), targets)
    loss.backward()
    opt.step()
    sched.step()
    return loss
"""


def _setup(ip):
    assert ip.run_cell(SETUP).success
    ns = ip.user_ns
    return {"model": copy.deepcopy(ns["model"].state_dict()),
            "opt": copy.deepcopy(ns["opt"].state_dict()),
            "sched": copy.deepcopy(ns["sched"].state_dict()),
            "names": set(ns), "rng": torch.get_rng_state(), "py": random.getstate()}


def _unchanged(ip, saved):
    ns = ip.user_ns
    for k, v in ns["model"].state_dict().items():
        assert v.dtype == saved["model"][k].dtype and torch.equal(v, saved["model"][k]), k
    assert all(p.grad is None for p in ns["model"].parameters())
    assert ns["opt"].state_dict() == saved["opt"]  # AdamW made no state: no step survived
    assert ns["sched"].state_dict() == saved["sched"]
    assert ns["opt"].param_groups[0]["lr"] == 1e-2
    assert set(ns) - {"c", "r"} == saved["names"]
    assert torch.equal(torch.get_rng_state(), saved["rng"]) and random.getstate() == saved["py"]


def _first_step_loss(ip, start, dtype=None):
    """The loss of one train_step from the start, by hand (autocast when dtype is given)."""
    model = copy.deepcopy(ip.user_ns["model"])
    model.load_state_dict(start["model"])
    inputs, targets = ip.user_ns["data"][0]
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        return torch.nn.functional.cross_entropy(model(inputs), targets).detach()


def test_a_train_step_through_a_function_leaves_the_users_model_as_it_was(ip):
    start = _setup(ip)
    _amp(ip, "--compare bf16-mixed -r 3 -o c", "train_step()")
    _unchanged(ip, start)
    c = ip.user_ns["c"].comparison
    ref, bf16 = _first_step_loss(ip, start), _first_step_loss(ip, start, torch.bfloat16)
    # every run of every mode started from the same weights: the errors are one step's
    assert c.row("bf16-mixed").max_abs_error == (bf16.double() - ref.double()).abs().item() > 0
    assert c.row("bf16-mixed").result_dtypes == ("float32",)  # cross_entropy runs in fp32
    notes = " ".join(ip.user_ns["c"].notes)
    assert "restored after each run and at the end" in notes and "as before the cell" in notes
    for found in ("model (Sequential)", "opt (AdamW)", "sched (StepLR)"):
        assert found in notes


def test_a_second_32_true_row_has_error_zero_and_the_weights_after_one_step(ip):
    start = _setup(ip)
    # TF32 'emulate' makes a second 32-true entry; off it is the reference's twin
    _amp(ip, "--compare 32-true --tf32 off -r 2 -o c", "train_step()\nmodel[0].weight")
    ref = ip.user_ns["c"].comparison.reference
    assert ref.max_abs_error == 0
    _amp(ip, "--compare 32-true --tf32 emulate -r 2 -o c", "train_step()\nmodel[0].weight")
    c = ip.user_ns["c"].comparison
    assert c.labels == ("32-true", "32-true + TF32 emulate")
    assert 0 < c.row("32-true").max_abs_error < 1e-2
    _unchanged(ip, start)


def test_a_cell_without_a_value_compares_the_modules_it_changed(ip):
    start = _setup(ip)
    _amp(ip, "--compare bf16-mixed -r 1 -o c", "train_step()\nNone")
    c = ip.user_ns["c"].comparison
    # one AdamW step moves every weight by about lr: the modes differ in a few of them
    assert c.reference.result_dtypes == ("float32",)
    assert 0 < c.row("bf16-mixed").max_abs_error <= 2 * 1e-2
    _unchanged(ip, start)


def test_gradscaler_state_is_restored(ip):
    _setup(ip)
    ip.run_cell("scaler = torch.amp.GradScaler('cpu', init_scale=1024.0)\n"
                "def scaled_step():\n"
                "    opt.zero_grad()\n"
                "    loss = model(x).float().square().mean()\n"
                "    scaler.scale(loss).backward()\n"
                "    scaler.step(opt)\n"
                "    scaler.update()\n")
    scaler = ip.user_ns["scaler"]
    ip.run_cell("scaled_step()")  # the scaler now has a scale tensor and a growth tracker
    before = copy.deepcopy(scaler.state_dict())
    _amp(ip, "--compare 16-mixed -r 2", "scaled_step()")
    assert scaler.state_dict() == before


def test_state_held_in_a_closure_and_chained_schedulers_is_restored(ip):
    ip.run_cell(
        "def make_step():\n"
        "    net = torch.nn.Linear(16, 4)\n"
        "    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)\n"
        "    warm = torch.optim.lr_scheduler.LinearLR(opt, 0.5, total_iters=2)\n"
        "    decay = torch.optim.lr_scheduler.ExponentialLR(opt, 0.9)\n"
        "    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, decay], milestones=[2])\n"
        "    def step():\n"
        "        opt.zero_grad()\n"
        "        loss = net(x).square().mean()\n"
        "        loss.backward()\n"
        "        opt.step()\n"
        "        sched.step()\n"
        "        return loss\n"
        "    return step, net, sched\n"
        "step, _net, _sched = make_step()\n"
        "cycle = [1]\n"
        "cycle.append(cycle)")  # a cyclic list is skipped, not a crash
    step, net, sched = ip.user_ns["step"], ip.user_ns["_net"], ip.user_ns["_sched"]
    step()
    before = copy.deepcopy((net.state_dict(), sched.state_dict()))
    warm = sched._schedulers[0]
    _amp(ip, "--compare bf16-mixed -r 2", "step()")
    assert all(torch.equal(v, before[0][k]) for k, v in net.state_dict().items())
    assert sched.state_dict() == before[1] and sched._schedulers[0] is warm
    assert warm.optimizer is sched.optimizer and len(sched.optimizer.state) == 2


def test_true_modes_convert_a_model_made_before_the_cell(ip):
    lin, x = ip.user_ns["lin"], ip.user_ns["x"]
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    _amp(ip, "--compare 32-true,bf16-true,64-true -r 1 -o c", "y = lin(x)")
    c = ip.user_ns["c"].comparison
    y32 = lin(x).detach().double()
    for mode, dtype in (("bf16-true", torch.bfloat16), ("64-true", torch.float64)):
        by_hand = copy.deepcopy(lin).to(dtype)(x.to(dtype)).detach()
        assert c.row(mode).result_dtypes == (str(dtype)[6:],)
        assert c.row(mode).max_abs_error == (by_hand.double() - y32).abs().max().item() > 0
        assert c.row(mode).note == ""
    assert lin.weight.dtype == torch.float32 and torch.equal(lin.weight, w)
    assert torch.equal(lin.bias, b) and ip.user_ns["x"] is x and x.dtype == torch.float32
    assert "y" not in ip.user_ns
    assert any("bf16-true: lin, x converted" in n for n in ip.user_ns["c"].notes)


def test_a_true_mode_with_nothing_to_convert_says_so_in_its_row(ip):
    _amp(ip, "--compare bf16-true -r 1 -o c", "z = torch.ones(3) / 3")
    row = ip.user_ns["c"].comparison.row("bf16-true")
    assert row.result_dtypes == ("bfloat16",)
    assert row.note.startswith("not converted: no module made before the cell is named by it")
    assert "not converted: no module" in repr(ip.user_ns["c"])


def test_a_mode_that_fails_gets_its_row_and_the_others_run(ip):
    cell = ("if torch.is_autocast_enabled('cpu') and torch.get_autocast_dtype('cpu') == torch.float16:\n"
            "    raise RuntimeError('could not create a primitive\\nmore oneDNN text')\n"
            "y = lin(x)")
    _, out = _amp(ip, "--compare 16-mixed,bf16-mixed -r 1 -o c", cell)
    c = ip.user_ns["c"].comparison
    assert c.labels == ("32-true", "16-mixed", "bf16-mixed")
    assert c.row("16-mixed").failed and not c.row("bf16-mixed").failed
    assert c.row("bf16-mixed").result_dtypes == ("bfloat16",)
    text = _shown(out)
    assert "failed: RuntimeError: could not create a primitive" in text
    assert "more oneDNN text" not in text
    assert "y" not in ip.user_ns


def test_a_cell_that_raises_in_32_true_raises_and_restores(ip):
    start = _setup(ip)
    with pytest.raises(ZeroDivisionError):
        _amp(ip, "--compare bf16-mixed -r 1", "train_step()\n1 / 0")
    _unchanged(ip, start)


def test_keyboard_interrupt_in_the_cell_restores_everything(ip):
    start = _setup(ip)
    before = putback_state.torch_state()
    ip.run_cell("calls = [0]")
    start["names"].add("calls")
    cell = "calls[0] += 1\ntrain_step()\nif calls[0] == 3: raise KeyboardInterrupt"
    with pytest.raises(KeyboardInterrupt):
        _amp(ip, "--compare bf16-true,bf16-mixed -r 2", cell)
    assert putback_state.torch_state() == before
    _unchanged(ip, start)


def test_usage_error_checks_the_modes_before_running(ip):
    start = _setup(ip)
    with pytest.raises(UsageError, match="unknown precision mode 'nope'"):
        _amp(ip, "--compare bf16-mixed,nope", "train_step()")
    _unchanged(ip, start)


def test_after_load_ext_ampnb_compare_is_the_function():
    code = ("from IPython.core.interactiveshell import InteractiveShell\n"
            "ip = InteractiveShell.instance()\n"
            "ip.run_line_magic('load_ext', 'ampnb')\n"
            "ip.run_cell('import torch')\n"
            "ip.run_cell('%%amp --compare bf16-mixed -r 1 -q\\ny = torch.ones(2) @ torch.ones(2)')\n"
            "import ampnb\n"
            "print(callable(ampnb.compare), ampnb.compare.__module__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "ampnb.comparison.run"]
