"""The house (#43): placement is one function, and every runner decides a model's device with it.

`Precision.of`, `compare`, the doctor and the Workbench each take a model and a stated device;
on awkward inputs (no parameters, only meta tensors, a stated device that disagrees or does not
exist) they must all land on `device.place_model`'s answer, or all raise its error.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch
from torch import nn

import ampnb
from ampnb.comparison.run import CompareOptions, _checked
from ampnb.device import place_model
from ampnb.diagnosis import core as doctor_core
from ampnb.workbench import Workbench

ROOT = pathlib.Path(ampnb.__file__).parent


class _Placed(Exception):
    """The doctor's device, caught right after it was chosen (before any work runs)."""


def _outcome(call) -> tuple[str, str]:
    try:
        return ("device", str(call()))
    except ValueError as e:
        return ("error", str(e))


def _via_doctor(model: nn.Module, stated) -> str:
    def stop(modes, dev):
        raise _Placed(dev)

    original = doctor_core.plan
    doctor_core.plan = stop
    try:
        ampnb.doctor(model, torch.ones(2, 3), device=stated)
    except _Placed as placed:
        return str(placed.args[0])
    finally:
        doctor_core.plan = original
    raise AssertionError("the doctor ran past its placement")


def _with_buffer_only() -> nn.Module:
    m = nn.Module()
    m.register_buffer("scale", torch.ones(3))
    return m


MODELS = {
    "no parameters": nn.ReLU,
    "only a buffer": _with_buffer_only,
    "meta parameters": lambda: nn.Linear(3, 3, device="meta"),
    "cpu parameters": lambda: nn.Linear(3, 3),
}
STATED = [None, "auto", "cpu", "cpu:1", "cuda:0", "meta", "no-such-device"]


@pytest.mark.parametrize("stated", STATED)
@pytest.mark.parametrize("name", list(MODELS))
def test_every_runner_places_a_model_as_place_model_does(name, stated):
    model = MODELS[name]()
    want = _outcome(lambda: place_model(model, stated).device)
    got = {
        "Precision.of": _outcome(lambda: ampnb.Precision.of("32-true", model=model,
                                                            device=stated).device),
        "compare": _outcome(lambda: _checked(CompareOptions(modes=("32-true",), device=stated,
                                                            model=model))[3].device),
    }
    if name == "cpu parameters":  # the doctor and the Workbench take only a model that trains
        got["doctor"] = _outcome(lambda: _via_doctor(model, stated))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        got["Workbench"] = _outcome(lambda: Workbench(model, opt, nn.functional.mse_loss,
                                                      [(torch.ones(2, 3), torch.ones(2, 3))],
                                                      device=stated).placement.device)
    for runner, (kind, said) in got.items():
        assert kind == want[0], (runner, said, want)
        if kind == "device":
            assert said == want[1], runner
        else:  # refused; compare says what its mode needs where the device is absent
            assert str(stated) in said, (runner, said)


def _calls(tree: ast.AST, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and
            getattr(n.func, "id", getattr(n.func, "attr", None)) == name]


def test_no_runner_spells_out_the_model_placement_itself():
    """`place([("the model's parameters", model)], ...)` lives in device/placement.py only."""
    spelled = []
    for path in ROOT.rglob("*.py"):
        if path.relative_to(ROOT).as_posix() == "device/placement.py":
            continue
        for call in _calls(ast.parse(path.read_text()), "place"):
            if "the model's parameters" in ast.unparse(call):
                spelled.append(f"{path.relative_to(ROOT)}:{call.lineno}")
    assert spelled == []


@pytest.mark.parametrize("path", ["precision.py", "comparison/run.py", "diagnosis/core.py",
                                  "workbench/core.py", "instruments/memory.py"])
def test_the_runners_call_place_model(path):
    assert _calls(ast.parse((ROOT / path).read_text()), "place_model")


# ----- --compare hands modes on; compare() does not look them up again by name -------------------

def _unregistered_bf16():
    from ampnb.modes.mixed import Bf16Mixed

    class Mine(Bf16Mixed):
        name = "bf16-mixed-mine"  # in no registry: only the instance says what it is

    return Mine()


def test_compare_runs_the_mode_it_was_handed_not_one_looked_up_by_name():
    from ampnb.comparison import compare

    mine = _unregistered_bf16()
    lin, x = nn.Linear(4, 4), torch.randn(2, 4)
    c = compare(lambda: lin(x), [mine], repeat=1)
    row = c.rows[-1]
    assert row.mode == mine.name and not row.failed
    assert row.result_dtypes == ("bfloat16",)  # its autocast ran


def test_amp_compare_hands_compare_the_modes_themselves(monkeypatch):
    from _magics_kit import amp, shell_with_ampnb

    import ampnb.magics.compare_cell as cell
    from ampnb.modes import PrecisionMode, get_mode

    handed = []
    real = cell.compare

    def spy(work, modes, *args, **kwargs):
        handed.extend(modes)
        return real(work, modes, *args, **kwargs)

    monkeypatch.setattr(cell, "compare", spy)
    for ip in shell_with_ampnb():
        ip.user_ns.update(lin=nn.Linear(4, 4), x=torch.randn(2, 4))
        amp(ip, "--compare bf16-mixed,16-mixed --repeat 1", "y = lin(x)")
    assert handed == [get_mode("bf16-mixed"), get_mode("16-mixed")]
    assert all(isinstance(m, PrecisionMode) for m in handed)


# ----- StepSettings carries a Precision: no parallel mode/device record -------------------------

def test_step_settings_hold_a_precision_not_their_own_mode_and_device():
    import dataclasses

    from ampnb.step import StepSettings

    fields = [f.name for f in dataclasses.fields(StepSettings)]
    assert fields == ["precision", "tf32", "fp16_kernels", "keep_fp32"]


def _built_with_precision_of(tree: ast.AST, arg: ast.expr) -> bool:
    """`Precision.of(...)` itself, or a name bound to one in the same module."""
    def is_of(node: ast.expr) -> bool:
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "of" and getattr(node.func.value, "id", "") == "Precision")
    if is_of(arg):
        return True
    return isinstance(arg, ast.Name) and any(
        isinstance(n, ast.Assign) and is_of(n.value) and
        any(getattr(t, "id", None) == arg.id for t in n.targets) for n in ast.walk(tree))


def test_every_runner_builds_its_step_settings_from_precision_of():
    built = {}
    for path in ROOT.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for call in _calls(tree, "StepSettings"):
            where = f"{path.relative_to(ROOT)}:{call.lineno}"
            built[where] = bool(call.args) and _built_with_precision_of(tree, call.args[0])
    assert len(built) >= 10  # %%amp, compare, the Workbench, ranks, memory, what-if, ...
    assert [w for w, ok in built.items() if not ok] == []


@pytest.mark.parametrize("mode", ["16-mixed", "bf16-mixed", "32-true"])
def test_a_cells_settings_carry_the_precision_its_ranks_are_built_from(mode):
    from ampnb.distributed._ship import RankSettings
    from ampnb.magics.runs import settings

    s = settings(mode, "cpu", "off")
    assert isinstance(s.precision, ampnb.Precision)
    assert (s.mode, s.device) == (s.precision.mode, s.precision.device) == (ampnb.get_mode(mode),
                                                                              "cpu")
    assert (s.precision.scaler is not None) == ampnb.get_mode(mode).uses_scaler
    shipped = RankSettings.of(s)
    assert shipped.mode == s.precision.mode.name
    import pickle
    assert pickle.loads(pickle.dumps(shipped)) == shipped  # plain values for the rank processes


def test_the_workbench_steps_through_the_precision_its_settings_carry(monkeypatch):
    """One value: the step's context and its update see the same Precision, with the
    Workbench's own scaler (not a second, unused GradScaler beside it)."""
    import ampnb.workbench.core as bench

    seen = []
    real = bench.step_context

    def spy(settings, models=None):
        seen.append(settings.precision)
        return real(settings, models)

    monkeypatch.setattr(bench, "step_context", spy)
    model = nn.Linear(3, 3)
    wb = Workbench(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.mse_loss,
                   [(torch.ones(2, 3), torch.zeros(2, 3))], mode="16-mixed", device="cpu")
    record = wb.step()
    (p,) = seen
    assert p.scaler is wb.scaler and p.scaler is not None
    assert record.scale == p.scaler.get_scale()


# ----- the modes are no longer fed a device and a scaler at each call site -----------------------

def _callers(name: str) -> list[str]:
    return sorted(path.relative_to(ROOT).as_posix() for path in ROOT.rglob("*.py")
                  if _calls(ast.parse(path.read_text()), name))


def test_only_precision_step_runs_train_step():
    """Every runner steps through its Precision (`p.step`): the mode, device and scaler travel
    together (the doctor's runs, %%amp's memory, compare's fp8 side by side, the Workbench)."""
    assert _callers("train_step") == ["precision.py"]


def test_scalers_are_made_by_precision_of():
    """Where a mode needs a GradScaler, `Precision.of` makes it: the Workbench's own (carried
    across mode switches) and the DDP demo's (torch's recipe spelled out by hand) too."""
    assert _callers("make_scaler") == ["precision.py"]
