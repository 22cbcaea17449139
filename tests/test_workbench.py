"""Workbench against hand-written loops: lossless switching, per-mode dtypes, losses, restore."""

from __future__ import annotations

import contextlib
import copy
import math
import statistics
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ampnb import _state
from ampnb.modes import get_mode
from ampnb.workbench import PrecisionLossWarning, Workbench

CPU_MODES = ["32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "64-true"]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def make(seed: int = 0, n_batches: int = 3, huge: tuple[int, ...] = ()):
    """A tiny MLP, Adam and regression batches; batch i in `huge` overflows fp16."""
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                                    torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    batches = [(torch.randn(16, 8, generator=gen) * (1e6 if i in huge else 1.0),
                torch.randn(16, 4, generator=gen)) for i in range(n_batches)]
    return model, opt, torch.nn.functional.mse_loss, batches


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns (so NaN == NaN when the bits agree)."""
    return t.view(_INT_OF_SIZE[t.element_size()]) if t.is_floating_point() else t


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bit-identical, dtype included."""
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype
                                        and torch.equal(bits(a[k]), bits(b[k])) for k in a)


def same_floats(a: list[float], b: list[float]) -> bool:
    """Equal lists of Python floats, where NaN matches NaN."""
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y))
                                    for x, y in zip(a, b))


def opt_state(opt) -> dict:
    return copy.deepcopy(opt.state_dict())


def same_opt(a: dict, b: dict) -> bool:
    return a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys() and all(
        a["state"][i].keys() == b["state"][i].keys()
        and all(torch.equal(bits(a["state"][i][k]), bits(b["state"][i][k]))
                and a["state"][i][k].dtype == b["state"][i][k].dtype for k in a["state"][i])
        for i in a["state"])


# ----- lossless switching ------------------------------------------------------------------

@settings(max_examples=12, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(CPU_MODES), st.booleans()), min_size=1, max_size=6))
def test_switch_sequences_without_steps_are_bit_identical(switches):
    wb = Workbench(*make())
    wb.run(2)  # so that Adam has state to carry
    before, before_opt = weights(wb.model), opt_state(wb.optimizer)
    for mode, tf32 in switches:
        wb.set(mode=mode, tf32=tf32)
        assert all(p.dtype == get_mode(mode).param_dtype for p in wb.model.parameters())
        # The optimizer state follows the parameters' dtype (as torch's load_state_dict casts).
        assert all(v.dtype == p.dtype for p, s in wb.optimizer.state.items()
                   for k, v in s.items() if k != "step")
    wb.set(mode="32-true")
    assert same(weights(wb.model), before)
    assert same_opt(opt_state(wb.optimizer), before_opt)
    assert wb.notes == []


def _widen(t: torch.Tensor) -> torch.Tensor:
    """What an fp32 master keeps of a value: narrow floats widen exactly, fp32/fp64 stay."""
    return t.float() if t.is_floating_point() and t.dtype != torch.float64 else t


def _opt_as(state: dict, dtype: torch.dtype) -> dict:
    """Optimizer state cast the way torch's load_state_dict casts it ("step" stays as it is)."""
    out = copy.deepcopy(state)
    for s in out["state"].values():
        for k, v in s.items():
            if k != "step" and v.is_floating_point():
                s[k] = v.to(dtype)
    return out


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(CPU_MODES), st.integers(0, 2)), min_size=1, max_size=5))
def test_switches_between_steps_carry_exactly_what_trained_and_say_so(actions):
    """A model of the promise: the master is what last trained (widened), each mode gets it
    rounded once to its dtype, and a switch speaks exactly when it could not keep fp32/fp64."""
    wb = Workbench(*make())
    master, master_opt, stepped = weights(wb.model), opt_state(wb.optimizer), 0
    for mode, n in [*actions, ("32-true", 0)]:
        if get_mode(mode) is wb.mode:  # nothing to switch: nothing changes, nothing is said
            live, live_opt = weights(wb.model), opt_state(wb.optimizer)
            assert wb.set(mode=mode) == ()
            assert same(weights(wb.model), live) and same_opt(opt_state(wb.optimizer), live_opt)
        else:
            narrow = wb.param_dtype in (torch.float16, torch.bfloat16)
            if stepped:
                master = {k: _widen(v) for k, v in weights(wb.model).items()}
                master_opt = _opt_as(opt_state(wb.optimizer), torch.float32)
                if wb.param_dtype == torch.float64:
                    master_opt = opt_state(wb.optimizer)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", PrecisionLossWarning)
                notes = wb.set(mode=mode)
            dtype = get_mode(mode).param_dtype
            wide = any(v.dtype == torch.float64 for v in master.values())
            assert bool(notes) == ((stepped > 0 and narrow) or (wide and dtype != torch.float64))
            assert same(weights(wb.model), {k: v.to(dtype) for k, v in master.items()})
            assert same_opt(opt_state(wb.optimizer), _opt_as(master_opt, dtype))
            stepped = 0
        wb.run(n)
        stepped += n
    assert wb.param_dtype == torch.float32


def test_optimizer_state_carries_on_across_switches_as_if_none_happened():
    losses, _, _, final = hand_loop("32-true", steps=5)
    wb = Workbench(*make())
    first = wb.run(2)
    for mode in ("bf16-true", "16-mixed", "64-true", "bf16-mixed", "32-true"):
        wb.set(mode=mode)  # no steps in between: Adam's moments and step count must survive
    rest = wb.run(3)
    assert [r.loss for r in first + rest] == losses
    assert same(weights(wb.model), final)
    assert opt_state(wb.optimizer)["state"][0]["step"] == 5


def test_steps_in_a_true_mode_are_carried_forward_and_said():
    wb = Workbench(*make())
    wb.set(mode="bf16-true")
    wb.step()
    live = {k: v.float() for k, v in weights(wb.model).items()}
    with pytest.warns(PrecisionLossWarning, match="bf16"):
        notes = wb.set(mode="32-true")
    assert notes and wb.notes == list(notes)
    assert same(weights(wb.model), live)  # exactly the bf16 values, widened
    assert wb.step().notes == notes        # the next record says so too
    assert wb.step().notes == ()


def test_steps_in_64_true_round_to_fp32_and_keep_the_fp64_master():
    wb = Workbench(*make())
    wb.set(mode="64-true")
    wb.step()
    live = weights(wb.model)
    with pytest.warns(PrecisionLossWarning, match="rounded to fp32"):
        wb.set(mode="32-true")
    assert same(weights(wb.model), {k: v.float() for k, v in live.items()})
    wb.set(mode="64-true")  # no steps in between: the fp64 values come back exactly
    assert same(weights(wb.model), live)


def test_optimizer_object_is_kept_and_repointed():
    model, opt, loss_fn, batches = make()
    wb = Workbench(model, opt, loss_fn, batches)
    wb.set(mode="16-true")
    assert wb.optimizer is opt and wb.model is model
    params = {id(p) for p in model.parameters()}
    assert all(id(p) in params for g in opt.param_groups for p in g["params"])
    assert opt.defaults == make()[1].defaults


def test_switching_through_transformer_engine_keeps_the_parameters():
    from ampnb.fp8.linear import Fp8Linear

    def fp8_layers():
        return [n for n, m in wb.model.named_modules() if isinstance(m, Fp8Linear)]

    model, opt, loss_fn, batches = make()
    wb = Workbench(model, opt, loss_fn, batches)
    start = weights(wb.model)
    wb.run(1)
    before, before_opt = weights(wb.model), opt_state(wb.optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the swap warns about a layer it skips
        wb.set(mode="transformer-engine")
        assert fp8_layers() == ["0"] and wb.param_dtype == torch.bfloat16
        wb.set(mode="32-true")
    # Before any FP8 step nothing is lost, and the plain layers are back.
    assert fp8_layers() == [] and wb.model is model
    assert same(weights(wb.model), before) and same_opt(opt_state(wb.optimizer), before_opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        wb.set(mode="transformer-engine")
        record = wb.step()
        live = {k: _widen(v) for k, v in weights(wb.model).items() if k in before}
        with pytest.warns(PrecisionLossWarning, match="bfloat16"):
            notes = wb.set(mode="32-true")
    # After one, its bf16 weights are carried forward, and that is said.
    assert record.mode == "transformer-engine" and notes and fp8_layers() == []
    assert same(weights(wb.model), live)
    wb.restore()
    assert same(weights(wb.model), start) and fp8_layers() == []


def test_probe_leaves_no_trace():
    """A probe (the panel's op trace) changes no weights, buffers, grads, RNG or history."""
    gen = torch.Generator().manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                torch.nn.Dropout(0.5), torch.nn.Linear(16, 4))
    batches = [(torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen))]
    wb = Workbench(model, torch.optim.SGD(model.parameters(), lr=0.1),
                   torch.nn.functional.mse_loss, batches, mode="bf16-mixed")
    wb.step()
    before, grads = weights(wb.model), [p.grad.clone() for p in wb.model.parameters()]
    rng, state = torch.get_rng_state(), _state.snapshot()

    @contextlib.contextmanager
    def saved():
        found: list[torch.dtype] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: found.append(t.dtype) or t,
                                                      lambda t: t):
            yield found

    seen = wb.probe(saved)
    assert torch.bfloat16 in seen and len(wb.history) == 1  # it ran, under the mode's autocast
    assert same(weights(wb.model), before)  # BatchNorm's running stats too
    assert all(torch.equal(p.grad, g) for p, g in zip(wb.model.parameters(), grads))
    assert torch.equal(torch.get_rng_state(), rng) and _state.snapshot() == state


# ----- dtypes and losses against hand-written loops --------------------------------------

def _autocast(dtype):
    return lambda: torch.autocast("cpu", dtype=dtype)


@contextlib.contextmanager
def _default_dtype(dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


# mode -> (module dtype, input dtype, forward context) as Lightning Fabric's plugins do it.
HAND = {
    "32-true": (torch.float32, torch.float32, contextlib.nullcontext),
    "bf16-mixed": (torch.float32, torch.bfloat16, _autocast(torch.bfloat16)),
    "16-mixed": (torch.float32, torch.float16, _autocast(torch.float16)),
    "bf16-true": (torch.bfloat16, torch.bfloat16, lambda: _default_dtype(torch.bfloat16)),
    "16-true": (torch.float16, torch.float16, lambda: _default_dtype(torch.float16)),
    "64-true": (torch.float64, torch.float64, lambda: _default_dtype(torch.float64)),
}


def hand_loop(mode: str, steps: int, huge=()):
    """The training loop written out with plain torch: losses, skips and final weights."""
    model, _, loss_fn, batches = make(huge=huge)
    p_dtype, x_dtype, ctx = HAND[mode]
    model.to(p_dtype)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu") if mode == "16-mixed" else None
    losses, skipped, out_dtypes = [], [], []
    for i in range(steps):
        x, y = batches[i % len(batches)]
        opt.zero_grad(set_to_none=True)
        with ctx():
            out = model(x.to(x_dtype))
        out_dtypes.append(out.dtype)
        loss = loss_fn(out.float(), y)
        if scaler:
            scale = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            skipped.append(scaler.get_scale() < scale)
        else:
            loss.backward()
            opt.step()
            skipped.append(False)
        losses.append(loss.item())
    return losses, skipped, out_dtypes, weights(model)


@pytest.mark.parametrize("mode", list(HAND))
def test_losses_dtypes_and_weights_match_a_hand_written_loop(mode):
    # Same ops on the same CPU in the same order, so equality is exact, not approximate.
    losses, skipped, out_dtypes, final = hand_loop(mode, steps=4)
    wb = Workbench(*make(), mode=mode)
    records = wb.run(4)
    # 16-true with Adam goes NaN after one step (eps=1e-8 is 0 in fp16): the same in both.
    assert same_floats([r.loss for r in records], losses)
    assert [r.skipped for r in records] == skipped
    assert [r.output_dtype for r in records] == out_dtypes
    assert all(r.param_dtype == HAND[mode][0] and r.mode == mode for r in records)
    assert same(weights(wb.model), final)


def test_16_mixed_skips_overflow_like_torch_and_keeps_the_scale_across_switches():
    losses, skipped, _, final = hand_loop("16-mixed", steps=3, huge=(1,))
    wb = Workbench(*make(huge=(1,)), mode="16-mixed")
    records = wb.run(3)
    assert [r.skipped for r in records] == skipped and any(skipped)
    assert same_floats([r.loss for r in records], losses)
    assert same(weights(wb.model), final)
    scale = wb.scaler.get_scale()
    assert scale < records[0].scale  # backed off after the overflow
    wb.set(mode="bf16-mixed")
    assert wb.scaler is None
    wb.set(mode="16-mixed")
    assert wb.scaler.get_scale() == scale


def test_mode_given_by_alias_and_inferred_from_the_model():
    assert Workbench(*make(), mode=16).mode.name == "16-mixed"
    model, _, loss_fn, batches = make()
    model.to(torch.bfloat16)
    wb = Workbench(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, batches)
    assert wb.mode.name == "bf16-true" and wb.param_dtype == torch.bfloat16


# ----- restore, bad input, global state ---------------------------------------------------

def test_restore_returns_to_the_start():
    wb = Workbench(*make())
    start, start_opt = weights(wb.model), opt_state(wb.optimizer)
    first = [r.loss for r in wb.run(2)]
    wb.set(mode="bf16-true", tf32=True)
    wb.run(2)
    with pytest.warns(PrecisionLossWarning):
        wb.set(mode="16-mixed")
    wb.step()
    wb.restore()
    assert same(weights(wb.model), start) and same_opt(opt_state(wb.optimizer), start_opt)
    assert (wb.mode.name, str(wb.device), wb.tf32, wb.history, wb.notes) == (
        "32-true", "cpu", False, [], [])
    assert [r.loss for r in wb.run(2)] == first


@pytest.mark.parametrize("bad, match", [
    (dict(mode="fp17"), "fp17"),
    (dict(device="cuda:7" if torch.cuda.is_available() else "cuda"), "cuda"),
    (dict(device="tpu"), "tpu"),
    (dict(tf32="yes"), "tf32"),
    (dict(mode="bf16-true", tf32=1), "tf32"),
])
def test_bad_settings_raise_one_line_and_change_nothing(bad, match):
    wb = Workbench(*make())
    wb.run(2)
    before, before_opt, state = weights(wb.model), opt_state(wb.optimizer), _state.snapshot()
    with pytest.raises(ValueError, match=match) as err:
        wb.set(**bad)
    assert "\n" not in str(err.value)
    assert same(weights(wb.model), before) and same_opt(opt_state(wb.optimizer), before_opt)
    assert (wb.mode.name, wb.tf32, _state.snapshot()) == ("32-true", False, state)


def test_bad_construction_raises_and_leaves_the_model_alone():
    model, opt, loss_fn, batches = make()
    before = weights(model)
    other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    cases = [dict(optimizer=other), dict(batches=[]), dict(loss_fn=3), dict(mode="nope"),
             dict(device="cuda:9"), dict(tf32="on"), dict(batches=[torch.ones(2)])]
    for case in cases:
        args = dict(model=model, optimizer=opt, loss_fn=loss_fn, batches=batches) | case
        with pytest.raises(ValueError):
            Workbench(**args)
    assert same(weights(model), before) and opt.state_dict()["state"] == {}


@pytest.mark.parametrize("mode", CPU_MODES)
@pytest.mark.parametrize("tf32", [False, True])
def test_global_state_restored_after_a_step_and_a_raising_loss(mode, tf32):
    state = _state.snapshot()
    wb = Workbench(*make(), mode=mode, tf32=tf32)
    wb.step()
    assert _state.snapshot() == state
    before = weights(wb.model)

    def broken(out, y):
        raise RuntimeError("loss exploded")

    wb.loss_fn = broken
    with pytest.raises(RuntimeError, match="loss exploded"):
        wb.step()
    assert _state.snapshot() == state
    assert same(weights(wb.model), before) and len(wb.history) == 1


# ----- measurements -----------------------------------------------------------------------

def test_memory_follows_element_size_and_speedup_is_from_the_records():
    wb = Workbench(*make())
    saved = {}
    with pytest.warns(PrecisionLossWarning):  # leaving bf16-true and 64-true after a step
        for mode in ("bf16-true", "32-true", "64-true", "bf16-mixed"):
            wb.set(mode=mode)
            saved[mode] = wb.step().memory
    assert 0 < saved["bf16-true"] < saved["32-true"] < saved["64-true"]
    assert wb.history[-1].cuda_peak is None
    wb.set(mode="16-true")
    assert wb.speedup() is None  # no 16-true steps yet
    wb.set(mode="bf16-mixed")
    wb.run(3)
    wb.set(mode="32-true")
    wb.run(3)
    wb.set(mode="bf16-mixed")

    def median(mode):
        return statistics.median(r.seconds for r in wb.history
                                 if r.mode == mode and not r.first_after_switch)

    ref, cur = median("32-true"), median("bf16-mixed")
    assert wb.speedup() == ref / cur
    only_bf16 = Workbench(*make(), mode="bf16-mixed")
    only_bf16.run(2)
    assert only_bf16.speedup() is None  # no 32-true reference measured yet


def test_demo_model_trains():
    from ampnb.models import demo

    wb = Workbench(*demo("mlp", seed=0, n_batches=2, batch_size=32))
    wb.set(mode="bf16-mixed")
    records = wb.run(4)
    assert all(r.output_dtype == torch.bfloat16 for r in records)
    assert "bf16-mixed" in repr(wb) and "bf16-mixed" in wb._repr_html_()


@needs_cuda
def test_cuda_round_trip_is_lossless_and_measures_peak():
    wb = Workbench(*make())
    wb.run(1)
    before = weights(wb.model)
    wb.set(device="cuda", mode="16-true")
    record = wb.step()
    assert record.device.startswith("cuda") and record.cuda_peak > 0
    wb.restore()
    wb.run(1)
    wb.set(device="cuda", mode="bf16-mixed")
    wb.set(device="cpu", mode="32-true")
    assert same(weights(wb.model), before)
