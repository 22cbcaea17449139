"""APEX's opt levels as legacy modes, each checked against a hand-written native torch loop."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from _magics_kit import amp as _amp
from _magics_kit import shell_with_ampnb
from _magics_kit import shown as _shown
from torch import nn
from torch.optim import optimizer as optim_hooks

import ampnb
from ampnb import putback_state
from ampnb.apex import lost_update, master_of, master_step, master_step_hooks
from ampnb.modes import MODES, get_mode

STEPS = 4


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def _batches(n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(n)]


def _optimizer(params, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=1e-3)


def _workbench_params(mode: str, kind: str) -> list[torch.Tensor]:
    model = _model()
    wb = ampnb.Workbench(model, _optimizer(model.parameters(), kind), nn.CrossEntropyLoss(),
                         _batches(), mode=mode)
    wb.run(STEPS)
    return [p.detach().clone() for p in wb.model.parameters()]


def _o2_reference(kind: str) -> list[torch.Tensor]:
    """By hand: fp16 model but batch norm, fp32 masters in the optimizer, dynamic loss scale."""
    model = _model()
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.half()
    params = list(model.parameters())
    masters = [p.detach().float() if p.dtype == torch.float16 else p for p in params]
    opt = _optimizer(masters, kind)
    scale = 2.0 ** 16  # APEX's and GradScaler's initial scale
    for x, y in _batches():
        for p in params:
            p.grad = None
        loss = nn.functional.cross_entropy(model(x.half()).float(), y)
        (loss * scale).backward()
        grads = [p.grad.float() * (1.0 / scale) for p in params]
        if not all(torch.isfinite(g).all() for g in grads):
            scale /= 2
            continue
        for m, g in zip(masters, grads, strict=True):
            m.grad = g
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters, strict=True):
                if p is not m:
                    p.copy_(m)
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_o2_matches_a_hand_written_fp16_weights_fp32_master_loop_bit_for_bit(kind):
    got = _workbench_params("apex-O2", kind)
    want = _o2_reference(kind)
    assert [p.dtype for p in got] == [p.dtype for p in want]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_o2_differs_from_stepping_the_fp16_weights_directly():
    # The masters matter: without them (O3-style steps on fp16 weights) the result differs.
    assert not all(torch.equal(a, b) for a, b in zip(_workbench_params("apex-O2", "sgd"),
                                                      _workbench_params("apex-O3", "sgd"),
                                                      strict=True))


def test_o1_matches_plain_autocast_and_gradscaler():
    model = _model()
    opt = _optimizer(model.parameters(), "sgd")
    scaler = torch.amp.GradScaler("cpu")
    for x, y in _batches():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x.half())
        loss = nn.functional.cross_entropy(out.float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    got = _workbench_params("apex-O1", "sgd")
    assert all(torch.equal(a, b.detach()) for a, b in zip(got, model.parameters(), strict=True))


def test_o3_matches_a_half_model_without_scaling():
    model = _model().half()
    opt = _optimizer(model.parameters(), "sgd")
    for x, y in _batches():
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x.half()).float(), y).backward()
        opt.step()
    got = _workbench_params("apex-O3", "sgd")
    assert all(torch.equal(a, b.detach()) for a, b in zip(got, model.parameters(), strict=True))


def test_o0_is_fp32_training():
    assert all(torch.equal(a, b) for a, b in zip(_workbench_params("apex-O0", "sgd"),
                                                  _workbench_params("32-true", "sgd"), strict=True))


def test_o2_keeps_batch_norm_in_fp32_and_returns_fp32_outputs():
    mode = get_mode("apex-O2")
    model = mode.convert_module(_model())
    bn = model[1]
    assert {t.dtype for t in (bn.weight, bn.bias, bn.running_mean, bn.running_var)} == {torch.float32}
    assert model[0].weight.dtype == model[3].weight.dtype == torch.float16
    out = mode.convert_output(model(mode.convert_input(torch.randn(4, 8))))
    assert out.dtype == torch.float32
    assert mode.make_scaler().get_scale() == 2.0 ** 16 and mode.uses_scaler


def test_lost_update_is_lost_in_o3_and_kept_by_o2s_master():
    demo = lost_update(weight=1.5, steps=8)
    half_ulp = torch.finfo(torch.float16).eps / 2  # at w in [1, 2) an ulp is eps
    assert demo.update < half_ulp
    w16 = torch.tensor(demo.weight, dtype=torch.float16)
    assert torch.equal(w16 - torch.tensor(demo.update, dtype=torch.float16), w16)  # one step is lost
    expected = float(torch.tensor(demo.weight, dtype=torch.float64) - demo.steps * demo.update)
    after = {mode: value for mode, _, value in demo.rows}
    assert after["apex-O3"] == demo.weight and not demo.kept("apex-O3")
    assert after["apex-O2"] == float(torch.tensor(expected).half()) and demo.kept("apex-O2")
    assert after["16-mixed"] == expected
    assert "lost" in repr(demo) and "kept" in repr(demo)


def test_apex_modes_are_labelled_legacy_and_found_by_their_spellings():
    for level in range(4):
        mode = MODES[f"apex-O{level}"]
        assert get_mode(f"APEX-O{level}") is mode
        assert "legacy" in mode.description and "emulated with native torch" in mode.description
        assert "legacy" in mode.availability("cpu").reason
    assert get_mode("apex") is MODES["apex-O2"]  # amp_backend="apex" defaulted to amp_level="O2"


@pytest.fixture
def ip():
    yield from shell_with_ampnb()


def test_amp_cell_steps_fp32_masters_and_removes_its_hooks(ip):
    w = nn.Parameter(torch.tensor([1.5], dtype=torch.float16))
    ip.user_ns.update(w=w, opt=torch.optim.SGD([w], lr=2.0 ** -12))
    cell = "for _ in range(8):\n    opt.zero_grad()\n    w.sum().backward()\n    opt.step()"
    _, out = _amp(ip, "apex-O2", cell)
    assert float(w.detach()) == float(torch.tensor(1.5 - 8 * 2.0 ** -12).half()) != 1.5
    assert "legacy" in _shown(out) and "convert_module(model)" in _shown(out)
    assert not optim_hooks._global_optimizer_pre_hooks
    assert not optim_hooks._global_optimizer_post_hooks
    assert ip.user_ns["opt"].param_groups[0]["params"][0] is w  # pointed back at the fp16 weight
    _amp(ip, "16-true", cell)  # no masters outside apex-O2: the update is lost again
    assert float(w.detach()) == float(torch.tensor(1.5 - 8 * 2.0 ** -12).half())


def test_a_failing_step_inside_the_cell_leaves_the_optimizer_pointed_at_its_weights(ip):
    before = putback_state.torch_state()
    w = nn.Parameter(torch.tensor([1.5], dtype=torch.float16))
    opt = torch.optim.SGD([w], lr=0.1)
    opt.register_step_post_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    ip.user_ns.update(w=w, opt=opt)
    result = ip.run_cell("%%amp apex-O2\nw.sum().backward()\nopt.step()")
    assert isinstance(result.error_in_exec, RuntimeError)
    assert opt.param_groups[0]["params"][0] is w and w.dtype == torch.float16
    assert not optim_hooks._global_optimizer_pre_hooks
    assert putback_state.torch_state() == before


def test_workbench_carries_o2s_fp32_masters_out_and_back():
    model = _model()
    wb = ampnb.Workbench(model, _optimizer(model.parameters(), "adam"), nn.CrossEntropyLoss(),
                         _batches(), mode="apex-O2")
    wb.run(2)
    masters = [master_of(p).detach().clone() for p in wb.model.parameters()]
    assert any(not torch.equal(m, m.half().float()) for m in masters)  # finer than fp16
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing lost, nothing to warn about
        wb.set(mode="32-true")
    assert all(torch.equal(p.detach(), m) for p, m in zip(wb.model.parameters(), masters, strict=True))
    wb.run(1)
    wb.set(mode="apex-O2")
    records = wb.run(2)
    assert all(torch.isfinite(torch.tensor(r.loss)) for r in records)
    assert records[-1].param_dtype == torch.float16
    snapshot = copy.deepcopy(wb.optimizer.state_dict())
    assert all(v.dtype == torch.float32 for s in snapshot["state"].values()
               for k, v in s.items() if torch.is_tensor(v) and k != "step")


def _swept_world():
    w = nn.Parameter(torch.tensor([1.5, -2.0], dtype=torch.float16))
    bn = nn.Parameter(torch.ones(2))  # fp32: stepped directly, as APEX steps fp32 parameters
    opt = torch.optim.SGD([w, bn], lr=2.0 ** -12, momentum=0.9)
    opt.step()  # momentum buffers exist before the sweep
    (w.sum() + bn.sum()).backward()
    return w, bn, opt, putback_state.torch_state()


def _left_as_found(world) -> list[str]:
    w, bn, opt, before = world
    problems = []
    if list(map(id, opt.param_groups[0]["params"])) != [id(w), id(bn)] or w.dtype != torch.float16:
        problems.append("the optimizer was left pointing at a master")
    if set(map(id, opt.state)) - {id(w), id(bn)}:
        problems.append("optimizer state left keyed by a master")
    if optim_hooks._global_optimizer_pre_hooks or optim_hooks._global_optimizer_post_hooks:
        problems.append("a global optimizer hook was left behind")
    if putback_state.torch_state() != before:
        problems.append("torch state changed")
    return problems


@pytest.mark.parametrize("hooks", [False, True])
def test_interrupt_anywhere_in_a_master_step_leaves_the_optimizer_as_found(hooks):
    from _sweep import sweep

    def run(world):
        opt = world[2]
        with master_step_hooks() if hooks else master_step(opt):
            opt.step()

    tried, leaks = sweep(_swept_world, run, _left_as_found, budget=150)
    assert tried > 20 and not leaks, leaks[:3]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"weight": 1.3}, "weight=1.3 is not allowed; allowed: a normal fp16 number"),
    ({"weight": 1e6}, "weight=1000000.0 is not allowed"),
    ({"steps": 0}, "steps=0 is not allowed"),
])
def test_lost_update_refuses_weights_fp16_cannot_hold(kwargs, match):
    with pytest.raises(ValueError, match=match):
        lost_update(**kwargs)


@pytest.mark.parametrize("weight", [1.0, -3.0, 0.0625, 1000.0])
def test_lost_update_holds_at_other_weights(weight):
    demo = lost_update(weight=weight, steps=4)
    spacing = float(torch.tensor(abs(weight)).half().nextafter(torch.tensor(65504.0).half()).float()
                    - abs(weight))
    assert demo.update == spacing / 4
    assert not demo.kept("apex-O3") and demo.kept("apex-O2") and demo.kept("16-mixed")
