"""The house (#43): a `Precision` is the only thing that hands a mode its device or its scaler.

The step (`train_step`, `forward_loss`) takes a Precision; the doctor's candidates, the
Workbench's probe, RangeExplorer, what_if, the optimizer comparison, the ScalerStepper and the DDP
demo all run through one; each places its model with `device.place_model`.
"""

from __future__ import annotations

import ast
import inspect
import pathlib

import pytest
import torch
from torch import nn

import ampnb
from ampnb.batch import as_batch
from ampnb.precision import Precision

ROOT = pathlib.Path(ampnb.__file__).parent

# A mode's hooks that take a device or a scaler, and the positional arguments the Precision's
# own method of that name takes: a call with more (or with device=/scaler=) feeds a mode.
_HOOKS = {"forward_context": 0, "kernel_context": 0, "make_scaler": 0, "backward": 1,
          "optimizer_step": 1}
_ALLOWED = ("precision.py", "modes/")  # the Precision itself, and the modes' own code


def _feeds_a_mode(call: ast.Call) -> bool:
    func = call.func
    if not isinstance(func, ast.Attribute) or func.attr not in _HOOKS:
        return False
    if ast.unparse(func.value).startswith("torch"):  # torch.autograd.backward(tensors, grads)
        return False
    return (len(call.args) > _HOOKS[func.attr]
            or any(k.arg in ("device", "scaler") for k in call.keywords))


def _sites() -> list[str]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        where = path.relative_to(ROOT).as_posix()
        if where.startswith(_ALLOWED):
            continue
        found += [f"{where}:{n.lineno} {ast.unparse(n)[:60]}"
                  for n in ast.walk(ast.parse(path.read_text()))
                  if isinstance(n, ast.Call) and _feeds_a_mode(n)]
    return found


def test_the_rule_sees_a_mode_fed_its_device_or_scaler():
    fed = ["mode.forward_context(device)", "s.mode.kernel_context(s.device, k)",
           "mode.make_scaler('cpu')", "mode.backward(loss, scaler)",
           "mode.optimizer_step(opt, scaler, clip)", "m.backward(loss, scaler=s)"]
    own = ["p.forward_context()", "p.kernel_context(fp16_kernels=k)", "p.backward(loss)",
           "p.optimizer_step(opt, before_update=clip)", "loss.backward()",
           "torch.autograd.backward([t], [g])"]
    assert all(_feeds_a_mode(ast.parse(c).body[0].value) for c in fed)
    assert not any(_feeds_a_mode(ast.parse(c).body[0].value) for c in own)


def test_no_module_but_precision_hands_a_mode_its_device_or_scaler():
    assert _sites() == []


def test_only_precision_of_makes_a_scaler():
    assert sorted({s.split(":")[0] for s in _sites() if "make_scaler" in s}) == []
    makers = sorted(p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py")
                    if ".make_scaler(" in p.read_text())
    assert [m for m in makers if not m.startswith(_ALLOWED)] == []


# ----- the step takes a Precision -----------------------------------------------------------------

def test_train_step_and_forward_loss_take_a_precision_not_a_device_or_scaler():
    from ampnb.step import forward_loss, train_step

    for f in (train_step, forward_loss):
        params = list(inspect.signature(f).parameters)
        assert params[0] == "precision" and not {"mode", "device", "scaler"} & set(params), f


def _net_and_data():
    g = torch.Generator().manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    with torch.no_grad():
        for q in net.parameters():
            q.copy_(torch.randn(q.shape, generator=g))
    return net, torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def test_train_step_on_a_precision_is_torchs_amp_recipe_bit_for_bit():
    from ampnb.step import train_step

    mine, x, y = _net_and_data()
    ref, _, _ = _net_and_data()
    opt, ref_opt = (torch.optim.SGD(n.parameters(), lr=0.1) for n in (mine, ref))
    p = Precision.of("bf16-mixed", model=mine)
    for _ in range(2):
        done = train_step(p, mine, opt, as_batch((x, y), nn.functional.mse_loss),
                          nn.functional.mse_loss)
        ref_opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the hand-written recipe
            loss = nn.functional.mse_loss(ref(x), y)
        loss.backward()
        ref_opt.step()
        assert torch.equal(done.loss, loss.detach())
    assert all(torch.equal(a, b) for a, b in zip(mine.parameters(), ref.parameters()))


def test_train_step_scales_with_the_precisions_own_scaler():
    from ampnb.step import train_step

    net, x, y = _net_and_data()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    p = Precision.of("16-mixed", model=net, scaler=scaler)
    done = train_step(p, net, torch.optim.SGD(net.parameters(), lr=0.1),
                      as_batch((x, y), nn.functional.mse_loss), nn.functional.mse_loss)
    assert done.scale == 2.0**4 and p.scaler is scaler


# ----- every runner places its model with place_model ---------------------------------------------

def _buffers_only() -> nn.Module:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("scale", torch.full((3,), 2.0))

        def forward(self, x):
            return x * self.scale

    return Scaled()


@pytest.fixture
def placed(monkeypatch):
    """The models `device.placement.place` was asked to place (place_model's one spelling)."""
    import ampnb.device.placement as placement

    seen: list = []
    real = placement.place

    def spy(sources, *args, **kwargs):
        sources = list(sources)
        seen.extend(v for label, v in sources if label == "the model's parameters")
        return real(sources, *args, **kwargs)

    monkeypatch.setattr(placement, "place", spy)
    return seen


def test_what_if_places_a_buffers_only_model_with_place_model(placed):
    model = _buffers_only()
    with pytest.raises(ValueError, match="ran no Linear or Conv layer"):
        ampnb.what_if(model, torch.ones(2, 3))
    assert any(m is model for m in placed)


def test_range_explorer_places_a_buffers_only_model_with_place_model(placed):
    pytest.importorskip("ipywidgets")
    from ampnb.panels.range_explorer import RangeExplorer

    model = _buffers_only()
    RangeExplorer(model, torch.ones(2, 3))
    assert any(m is model for m in placed)


class _MetaFirst(nn.Module):
    """A model whose first parameter is on meta (an unused, not yet materialised part): it runs
    where its real parameters are, as place_model says."""

    def __init__(self) -> None:
        super().__init__()
        self.later = nn.Linear(3, 3, device="meta")
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(x)


def test_what_if_runs_a_model_where_place_model_puts_it():
    result = ampnb.what_if(_MetaFirst(), (torch.ones(2, 3), torch.zeros(2, 3)),
                           nn.functional.mse_loss, formats=("bf16",))
    from ampnb.device import place_model

    assert result.device == place_model(_MetaFirst()).device == "cpu"


def test_compare_optimizers_places_the_demo_with_place_model(placed):
    from ampnb.lowbit.optim_compare import RUNS, compare_optimizers

    kw = dict(width=32, depth=1, n_head=2, batch_size=2, n_batches=2, seq_len=8)
    compare_optimizers("gpt", steps=1, runs={"Adam": RUNS["Adam (fp32 state)"]}, **kw)
    assert len(placed) >= 2  # the memory meter's and the training loop's


# ----- the doctor's candidate: a mode on a device, bound afresh for every run ---------------------

def test_a_candidate_is_a_mode_on_a_device_and_each_run_binds_a_fresh_scaler():
    from ampnb.diagnosis.candidates import candidate

    cand = candidate("16-mixed", "cpu")
    assert cand.device == "cpu"
    first, second = cand.bound(), cand.bound(2.0**3)
    assert (first.mode, first.device) == (second.mode, second.device) == (cand.mode, "cpu")
    assert first.scaler is not second.scaler  # every run starts from the snapshot
    assert second.scaler.get_scale() == 2.0**3
    assert list(inspect.signature(cand.context).parameters) == []  # its device is its own


# ----- the ScalerStepper steps through its own scaler ---------------------------------------------

def _stepper(**kw):
    from test_scaler import make

    from ampnb.scaler import ScalerStepper

    model, opt, loss_fn, batches = make()
    return ScalerStepper(model, opt, loss_fn, batches, **kw)


def test_the_stepper_steps_through_a_precision_holding_its_own_scaler(monkeypatch):
    seen = []
    real = Precision.backward

    def spy(self, loss):
        seen.append(self.scaler)
        return real(self, loss)

    monkeypatch.setattr(Precision, "backward", spy)
    stepper = _stepper(init_scale=2.0**8)
    stepper.step()
    assert seen == [stepper.scaler] and seen[0] is stepper.scaler
    stepper.reset(init_scale=2.0**4)  # a new scaler: the Precision that steps holds it
    stepper.step()
    assert seen[-1] is stepper.scaler and stepper.history[-1].scale == 2.0**4


def test_the_stepper_without_scaling_is_the_stated_route_not_a_disabled_scaler(monkeypatch):
    seen = []
    real = Precision.backward
    monkeypatch.setattr(Precision, "backward", lambda self, loss: (seen.append(self), real(self, loss))[1])
    stepper = _stepper(enabled=False)
    stepper.step()
    (p,) = seen
    assert p.mode.name == "16-mixed" and p.scaler is None and not stepper.scaler.is_enabled()


def test_precision_of_states_no_loss_scaling_and_still_refuses_a_disabled_scaler():
    p = Precision.of("16-mixed", device="cpu", loss_scaling=False)
    assert p.scaler is None and p.mode.name == "16-mixed"
    assert Precision.of("bf16-mixed", device="cpu", loss_scaling=False).scaler is None
    with pytest.raises(ValueError, match="disabled"):
        Precision.of("16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu", enabled=False))
    with pytest.raises(ValueError, match="loss_scaling=False"):
        Precision.of("16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu"),
                     loss_scaling=False)


def _first_parameter_devices(tree: ast.AST) -> list[int]:
    """Lines that read a device off a model's first parameter (`next(...parameters()).device`,
    or a name bound to that first parameter and then asked for `.device`)."""
    def first(node: ast.AST) -> bool:
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "next" and "parameters()" in ast.unparse(node))

    bound = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and first(n.value)
             for t in n.targets if isinstance(t, ast.Name)}
    return [n.lineno for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr == "device"
            and (first(n.value) or isinstance(n.value, ast.Name) and n.value.id in bound)]


def test_the_device_rule_sees_a_first_parameters_device():
    seen = _first_parameter_devices(ast.parse(
        "def f(m):\n    a = next(m.parameters()).device\n"
        "    p = next(iter(m.parameters()), None)\n    return p.device\n"))
    assert seen == [2, 4]


# `device` places; the rooms below it (the modes and the FP8 layers they swap in, which
# tests/test_import.py keeps from importing `device`) convert each layer where its weights are.
_BELOW_PLACEMENT = ("device/", "modes/", "fp8/")


def test_no_runner_takes_its_device_from_a_first_parameter():
    """Placement is one function: `device.place_model` (a model whose first parameter is on meta,
    or that has buffers only, runs where it says)."""
    found = [f"{p.relative_to(ROOT).as_posix()}:{line}" for p in sorted(ROOT.rglob("*.py"))
             if not p.relative_to(ROOT).as_posix().startswith(_BELOW_PLACEMENT)
             for line in _first_parameter_devices(ast.parse(p.read_text()))]
    assert found == []
