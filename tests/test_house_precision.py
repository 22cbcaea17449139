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
