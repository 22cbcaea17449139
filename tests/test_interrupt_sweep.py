"""A KeyboardInterrupt at any line ampnb executes leaves the state a clean run would leave.

For a handful of representative cells (each mode, --compare, --trace --hunt --memory, --tf32,
a PrecisionPanel mode round trip), the sweep delivers an interrupt at evenly sampled lines of
ampnb's own code (tests/_sweep.py) and checks global torch state, SIGINT handling, hooks,
the user's weights and the Workbench's consistency after each.
"""

from __future__ import annotations

import copy
import os
import signal

import pytest
import torch
from _magics_kit import loaded_shell
from _sweep import sweep
from IPython.utils.capture import capture_output

from ampnb import _interrupt, backwards, putback_state
from ampnb.instruments.trace import is_internal, trace_ops

# Interrupt points per scenario: 60 keeps the sweep well under 2 minutes; AMPNB_SWEEP_BUDGET=0
# tries every line (minutes).
BUDGET = int(os.environ.get("AMPNB_SWEEP_BUDGET", "60")) or 10**9


ip = pytest.fixture(scope="module", name="ip")(loaded_shell)


def _common(before: putback_state.TorchState) -> list[str]:
    problems = []
    after = putback_state.torch_state()
    if after != before:
        changed = [k for k in before.__dataclass_fields__ if getattr(before, k) != getattr(after, k)]
        problems.append(f"torch state changed: {', '.join(changed)}")
    if backwards._here.inside or backwards._here.held is not None:
        problems.append("ampnb.backwards left a backward marked running or its mode held aside")
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        problems.append(f"SIGINT handler left as {signal.getsignal(signal.SIGINT)!r}")
    if _interrupt._pending:
        problems.append("an interrupt is still pending")
    if is_internal():
        problems.append("ampnb's internal() counter is stuck: traces would see nothing")
    return problems


def _traces_still_work() -> list[str]:
    with trace_ops() as t:
        torch.ones(2) * 2
    return [] if t.rows else ["a fresh trace_ops after the interrupt saw no ops"]


def _cell_world(ip):
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(8, 4)
    ip.user_ns.update(torch=torch, lin=lin, x=torch.randn(3, 8, generator=g))
    return {"ip": ip, "lin": lin, "weights": copy.deepcopy(lin.state_dict()),
            "before": putback_state.torch_state()}


def _cell_check(world) -> list[str]:
    problems = _common(world["before"])
    ns = world["ip"].user_ns
    if ns.get("lin") is not world["lin"]:
        problems.append("the user's `lin` was rebound")
    sd = world["lin"].state_dict()
    if any(sd[k].dtype != v.dtype or not torch.equal(sd[k], v) for k, v in world["weights"].items()):
        problems.append("the user's weights changed")
    return problems + _traces_still_work()


CELLS = [
    ("32-true", "y = lin(x)"),
    ("bf16-mixed", "y = lin(x)"),
    ("16-mixed", "y = lin(x)"),
    ("bf16-true", "y = lin(x)"),
    ("64-true", "y = torch.ones(2)"),
    ("--compare 32-true,bf16-mixed --repeat 1", "y = lin(x)"),
    ("bf16-mixed --trace --hunt --memory", "lin(x).sum().backward()"),
    ("bf16-mixed", "torch.autograd.backward(lin(x).sum())"),  # the backward's mode and hooks
    ("32-true --tf32 emulate", "y = lin(x)"),
    ("16-mixed --fp16-kernels emulated", "lin(x).float().sum().backward()"),
]


@pytest.mark.parametrize(("line", "cell"), CELLS, ids=[f"{line} :: {cell}" for line, cell in CELLS])
def test_interrupt_anywhere_in_a_cell_leaks_nothing(ip, line, cell):
    def run(world):
        with capture_output():
            world["ip"].run_cell_magic("amp", line + " -q", cell)

    tried, leaks = sweep(lambda: _cell_world(ip), run, _cell_check, BUDGET)
    assert tried > 10
    assert not leaks, f"{len(leaks)} of {tried} interrupt points leaked:\n" + "\n".join(leaks[:10])


def _panel_world():
    from ampnb.models import demo
    from ampnb.panels import PrecisionPanel
    from ampnb.workbench import Workbench

    wb = Workbench(*demo("mlp"))
    panel = PrecisionPanel(wb)
    weights = {k: v.clone() for k, v in wb.model.state_dict().items()}
    return {"panel": panel, "wb": wb, "weights": weights, "before": putback_state.torch_state()}


def _panel_check(world) -> list[str]:
    problems = _common(world["before"])
    wb = world["wb"]
    dtypes = {p.dtype for p in wb.model.parameters()}
    if dtypes != {wb.mode.param_dtype}:
        problems.append(f"Workbench says {wb.mode.name} but its weights are {dtypes}")
    wb.set(mode="32-true")  # going back to fp32 must give the exact starting weights
    sd = wb.model.state_dict()
    if any(not torch.equal(sd[k].float(), v.float()) for k, v in world["weights"].items()):
        problems.append("the fp32 weights after returning to 32-true differ from the start")
    return problems + _traces_still_work()


def test_interrupt_anywhere_in_a_panel_mode_round_trip_leaks_nothing():
    def run(world):
        world["panel"].mode.value = "bf16-true"
        world["panel"].mode.value = "32-true"

    tried, leaks = sweep(_panel_world, run, _panel_check, BUDGET)
    assert tried > 10
    assert not leaks, f"{len(leaks)} of {tried} interrupt points leaked:\n" + "\n".join(leaks[:10])


def test_interrupt_anywhere_in_a_panel_keep_fp32_round_trip_leaks_nothing():
    def run(world):
        panel = world["panel"]
        panel.mode.value = "bf16-true"
        panel.keep_fp32.value = ("head",)
        panel.fp16_kernels.value = "emulated"
        panel.keep_fp32.value = ()
        panel.mode.value = "32-true"

    def check(world) -> list[str]:
        wb = world["wb"]
        problems = [] if wb.keep_fp32 in ((), ("head",)) else [f"keep_fp32 is {wb.keep_fp32}"]
        wb.set(keep_fp32=())  # then the same checks as a plain mode round trip
        return problems + _panel_check(world)

    tried, leaks = sweep(_panel_world, run, check, BUDGET)
    assert tried > 10
    assert not leaks, f"{len(leaks)} of {tried} interrupt points leaked:\n" + "\n".join(leaks[:10])


# ----- function entries in every frame (torch's and contextlib's too) ---------------------------

CALL_CELLS = [
    ("bf16-mixed", "lin(x).float().sum().backward()"),
    ("bf16-mixed", "torch.autograd.backward(lin(x).sum())"),
    ("16-mixed", "y = lin(x)"),
]


@pytest.mark.parametrize(("line", "cell"), CALL_CELLS,
                         ids=[f"{line} :: {cell}" for line, cell in CALL_CELLS])
def test_interrupt_at_any_function_entry_in_a_cell_leaks_nothing(ip, line, cell):
    """The autocast nesting counter, the mode stacks, hooks, SIGINT handler all as before."""
    from _sweep import changed, process_state

    def setup():
        world = _cell_world(ip)
        world["process"] = process_state()
        return world

    def run(world):
        with capture_output():
            world["ip"].run_cell_magic("amp", line + " -q", cell)

    def check(world):
        return _cell_check(world) + changed(world["process"], process_state())

    tried, leaks = sweep(setup, run, check, BUDGET, events="calls")
    assert tried > 10
    assert not leaks, f"{len(leaks)} of {tried} interrupt points leaked:\n" + "\n".join(leaks[:10])


def test_interrupt_at_any_function_entry_in_a_watched_loop_leaks_nothing():
    """A watch around a loop (a user's mode is left out: an interrupt landing in its own
    __torch_function__ as `no_grad` puts grad mode back cuts that restore, with or without ampnb)."""
    from _sweep import changed, process_state

    import ampnb

    def setup():
        m = torch.nn.Linear(8, 1)
        hooks = (dict(m._forward_hooks), dict(m._forward_pre_hooks))
        return {"m": m, "opt": torch.optim.SGD(m.parameters(), lr=0.1), "hooks": hooks,
                "process": process_state()}

    def run(w):
        with ampnb.watch(w["m"], w["opt"]):
            for _ in range(2):
                w["opt"].zero_grad()
                w["m"](torch.randn(2, 8)).sum().backward()
                w["opt"].step()

    def check(w):
        problems = changed(w["process"], process_state())
        if (dict(w["m"]._forward_hooks), dict(w["m"]._forward_pre_hooks)) != w["hooks"]:
            problems.append("the watch's hooks are still on the model")
        return problems

    tried, leaks = sweep(setup, run, check, BUDGET, events="calls")
    assert tried > 10
    assert not leaks, f"{len(leaks)} of {tried} interrupt points leaked:\n" + "\n".join(leaks[:10])
