"""ampnb.putback, the one home for putting things back: each primitive takes and puts back
exactly (checked against torch's, numpy's and Python's own readers), also after the values were
changed and when an interrupt lands in its set-up or restore; and no other module keeps its own."""

from __future__ import annotations

import copy
import json
import pathlib
import random
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from _sweep import sweep
from torch import nn

import ampnb
from ampnb import putback_state
from ampnb.putback import (
    Grads,
    ModuleFlags,
    ObjectCopy,
    OptimizerCopy,
    Rng,
    TensorCopy,
    rng_kept,
    seed,
    untouched,
)
from ampnb.putback_state import Globals, globals_kept, torch_state

ROOT = pathlib.Path(ampnb.__file__).parent


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))


def _draw() -> None:
    """Move every generator."""
    torch.rand(3)
    np.random.rand(3)
    random.random()


def _refs() -> tuple:
    """Every generator's state as torch, numpy and Python read it themselves."""
    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def _same_refs(a: tuple, b: tuple) -> bool:
    (ta, na, pa), (tb, nb, pb) = a, b
    return (torch.equal(ta, tb) and na[0] == nb[0] and np.array_equal(na[1], nb[1])
            and na[2:] == nb[2:] and pa == pb)


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _same_grads(a: list, b: list) -> bool:
    return len(a) == len(b) and all((x is None and y is None) or (
        x is not None and y is not None and torch.equal(x, y)) for x, y in zip(a, b))


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _net().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(6, 4)).sum().backward()
    opt.step()
    model(torch.randn(6, 4)).sum().backward()  # gradients left for the next step
    return model, opt


# ---------------------------------------------------------------- the global torch state


def test_state_snapshot_is_putbacks_reader():
    assert putback_state.torch_state is torch_state and putback_state.TorchState is putback_state.TorchState
    assert torch_state() == torch_state()


def test_globals_put_back_dtype_grad_tf32_and_a_dispatch_mode_left_behind():
    from ampnb.fp16_kernels import Fp16KernelEmulation

    before = torch_state()
    g = Globals.take()
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.set_float32_matmul_precision("medium")
    Fp16KernelEmulation().__enter__()  # as if an interrupt cut its with-block short
    assert torch_state() != before
    g.restore()
    assert torch_state() == before


def test_globals_kept_puts_back_when_the_body_raises():
    before = torch_state()
    with pytest.raises(ZeroDivisionError), globals_kept():
        torch.set_default_dtype(torch.float16)
        torch.set_float32_matmul_precision("high")
        1 / 0  # noqa: B018
    assert torch_state() == before


# ---------------------------------------------------------------- every RNG


def test_rng_takes_and_puts_back_every_generator():
    _draw()
    refs, rng = _refs(), Rng.take()
    assert torch.equal(rng.cpu, refs[0]) and rng.python == refs[2]
    for _ in range(3):
        _draw()
    assert not _same_refs(_refs(), refs) and not Rng.take().same(rng)
    rng.restore()
    assert _same_refs(_refs(), refs) and Rng.take().same(rng)


@pytest.mark.parametrize("draw", [lambda: torch.rand(1), lambda: np.random.rand(1),
                                  lambda: random.random(), lambda: np.random.standard_normal()],
                         ids=["torch", "numpy", "python", "numpy-gauss"])
def test_rng_same_sees_a_draw_from_each_generator(draw):
    rng = Rng.take()
    assert Rng.take().same(rng)
    draw()
    assert not Rng.take().same(rng)


def test_rng_kept_puts_back_when_the_body_raises():
    refs = _refs()
    with pytest.raises(ZeroDivisionError), rng_kept():
        _draw()
        1 / 0  # noqa: B018
    assert _same_refs(_refs(), refs)


def test_rng_as_a_dict_round_trips_and_leaves_out_absent_generators():
    rng = Rng.take()
    states = rng.as_dict()
    assert set(states) <= {"torch", "python", "cuda", "numpy"} and "torch" in states
    assert ("cuda" in states) == (rng.cuda is not None)
    refs = _refs()
    _draw()
    Rng.from_dict(states).restore()
    assert _same_refs(_refs(), refs)


def test_numpy_is_read_only_once_imported(monkeypatch):
    monkeypatch.delitem(sys.modules, "numpy")
    rng = Rng.take()
    assert rng.numpy is None and "numpy" not in sys.modules
    rng.restore()
    seed(1, "cpu")
    assert "numpy" not in sys.modules


def test_seed_seeds_each_generator_as_its_own_seeding_does():
    seed(7, "cpu")
    ours = (torch.rand(4), np.random.rand(4), random.random())
    torch.manual_seed(7)
    np.random.seed(7)
    random.seed(7)
    theirs = (torch.rand(4), np.random.rand(4), random.random())
    assert torch.equal(ours[0], theirs[0]) and np.array_equal(ours[1], theirs[1])
    assert ours[2] == theirs[2]


# ---------------------------------------------------------------- a model's and optimizer's copy


def test_tensor_copy_puts_back_value_grad_and_requires_grad():
    p = nn.Parameter(torch.randn(5))
    p.grad = torch.randn(5)
    value, grad = p.detach().clone(), p.grad.clone()
    saved = TensorCopy.take(p)
    assert not saved.changed()
    with torch.no_grad():
        p.mul_(3)
    p.grad.add_(1)
    p.requires_grad_(False)
    assert saved.changed()
    saved.restore()
    assert torch.equal(p, value) and torch.equal(p.grad, grad) and p.requires_grad
    assert not saved.changed()
    p.data = p.data.half()  # recast
    assert saved.changed()
    saved.restore()
    assert p.dtype == torch.float32 and torch.equal(p, value)


def test_module_flags_put_back_the_training_flag_and_rebound_slots():
    model = _net().train()
    weight, mean = model[0].weight, model[1].running_mean
    flags = [ModuleFlags.take(m) for m in model.modules()]
    model.eval()
    model[0].weight = nn.Parameter(torch.zeros(8, 4))
    model[1].running_mean = torch.ones(8)
    for f in flags:
        f.restore()
    assert all(m.training for m in model.modules())
    assert model[0].weight is weight and model[1].running_mean is mean


def test_optimizer_copy_puts_back_the_state_dict_exactly():
    model, opt = _trained()
    want = copy.deepcopy(opt.state_dict())
    saved = OptimizerCopy.take(opt)
    opt.step()
    opt.param_groups[0]["lr"] = 0.5
    saved.restore()
    got = opt.state_dict()
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for i, s in want["state"].items():
        assert s.keys() == got["state"][i].keys()
        assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(got["state"][i][k]))
                   for k, v in s.items())
    params = [p for g in opt.param_groups for p in g["params"]]
    assert all(a is b for a, b in zip(params, model.parameters()))  # kept by identity


def test_object_copy_puts_back_a_scalers_attributes():
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(()))  # the scale tensor exists from here on
    want = scaler.state_dict()
    saved = ObjectCopy.take(scaler, {})
    scaler.update(new_scale=8.0)
    scaler.set_backoff_factor(0.25)
    assert scaler.state_dict() != want
    saved.restore()
    assert scaler.state_dict() == want


@pytest.mark.parametrize("on_disk", [False, True])
def test_grads_set_aside_are_cleared_and_put_back_exactly(tmp_path, on_disk):
    model, _ = _trained()
    model[3].bias.grad = None  # one parameter without a gradient
    want = _grads(model)
    aside = Grads.take(model, str(tmp_path / "grads.pt") if on_disk else None)
    assert all(p.grad is None for p in model.parameters())
    model(torch.randn(6, 4)).sum().backward()  # new gradients meanwhile, on every parameter
    aside.restore()
    assert _same_grads(_grads(model), want) and model[3].bias.grad is None


def test_untouched_puts_back_buffers_grads_and_every_generator():
    model, opt = _trained()
    values, grads, refs = _tensors(model), _grads(model), _refs()
    with untouched(model):
        model(torch.randn(6, 4)).sum().backward()  # BatchNorm's running stats, dropout's draws
        _draw()
    assert _equal(_tensors(model), values) and _same_grads(_grads(model), grads)
    assert _same_refs(_refs(), refs)


def test_untouched_puts_back_when_the_probe_raises():
    model, _ = _trained()
    values, grads, refs = _tensors(model), _grads(model), _refs()
    with pytest.raises(RuntimeError), untouched(model):
        model(torch.randn(6, 4))
        _draw()
        model(torch.randn(6, 5))  # a shape error
    assert _equal(_tensors(model), values) and _same_grads(_grads(model), grads)
    assert _same_refs(_refs(), refs)


# ---------------------------------------------------------------- interrupts


def test_an_interrupt_at_any_line_of_untouched_leaves_the_model_and_generators():
    def setup():
        model, _ = _trained()
        return model, _tensors(model), _grads(model), _refs()

    def run(world):
        with untouched(world[0]):
            world[0](torch.randn(6, 4)).sum().backward()
            _draw()

    def check(world):
        model, values, grads, refs = world
        ok = (_equal(_tensors(model), values) and _same_grads(_grads(model), grads)
              and _same_refs(_refs(), refs))
        return [] if ok else ["not put back"]

    tried, leaks = sweep(setup, run, check, budget=40)
    assert tried > 10 and not leaks, leaks


def test_an_interrupt_at_any_line_of_the_safety_net_leaves_torch_state():
    from ampnb.fp16_kernels import Fp16KernelEmulation

    def run(_):
        with globals_kept():
            torch.set_default_dtype(torch.float64)
            Fp16KernelEmulation().__enter__()  # never exited: the net pops it

    def check(before):
        return [] if torch_state() == before else ["torch state changed"]

    tried, leaks = sweep(torch_state, run, check, budget=40)
    assert tried > 10 and not leaks, leaks


# ---------------------------------------------------------------- one home


# Each old home -> the module that now takes its copies from putback (the Workbench's probe
# moved out of workbench/state.py altogether).
OLD_HOMES = {"start.py": "start.py", "diagnosis/safety.py": "diagnosis/core.py",
             "comparison/snapshot.py": "comparison/snapshot.py",
             "workbench/state.py": "workbench/core.py", "watcher/overflow.py": "watcher/core.py"}

# Reading or setting a generator, or the global state the safety net puts back, by hand.
OWN_COPIES = [r"get_rng_state", r"set_rng_state", r"random\.getstate", r"random\.setstate",
              r"random\.get_state", r"random\.set_state", r"\brandom\.seed\(", r"manual_seed_all",
              r"\bfork_rng\b", r"\bmanual_seed\(", r"\.get_state\(\)", r"\.set_state\(",
              r"\bRandomState\(", r"default_rng\(",
              r"default_generator\.(get_state|manual_seed)", r"_get_current_dispatch_mode_stack",
              r"_python_dispatch import _pop_mode", r"\bdrop_overrides\(", r"class TorchState\b"]
# A model's or optimizer's set-aside copy, written out again.
OWN_MODEL_COPIES = [r"\.detach\(\)\.clone\(\)", r"_parameters\.(clear|update)",
                    r"_buffers\.(clear|update)", r"\.state\.update\(", r"param_groups\[:\]",
                    r"deepcopy\(dict\(vars\(", r"\.grad = None\b", r"\bp\.grad = "]


def _sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in ROOT.rglob("*.py")
            if not p.name.startswith("putback")}


def test_no_module_but_putback_reads_or_sets_a_generator_or_the_safety_nets_state():
    found = [f"{name}: {pattern}" for name, text in _sources().items() for pattern in OWN_COPIES
             if re.search(pattern, text) and not (name == "_kernels.py" and "drop_overrides" in pattern)]
    assert not found, found


def test_the_old_homes_keep_no_copy_of_their_own_and_use_putback():
    sources = _sources()
    assert "diagnosis/safety.py" not in sources  # the safety net is putback.globals_kept
    assert "_state.py" not in sources  # the state snapshot is putback_state.torch_state
    for name, user in OLD_HOMES.items():
        own = [p for p in OWN_MODEL_COPIES if re.search(p, sources.get(name, ""))]
        assert not own, (name, own)
        assert re.search(r"ampnb\.putback(_state)? import", sources[user]), user


@pytest.mark.parametrize("module", ["putback", "putback_state"])
def test_importing_putback_stays_light(module):
    code = (f"import json, sys, ampnb.{module}; print(json.dumps(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('ampnb', 'IPython', 'ipywidgets', 'matplotlib'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [
        "ampnb", "ampnb._interrupt", "ampnb._lazy", f"ampnb.{module}"]
