"""Workbench: lossless switching between modes, optimizer state carried on, probes leave no trace."""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
from _workbench_kit import (
    CPU_MODES,
    InterruptAt,
    consistent,
    hand_loop,
    make,
    opt_state,
    same,
    same_opt,
    weights,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from ampnb import putback_state
from ampnb.modes import get_mode
from ampnb.workbench import PrecisionLossWarning, Workbench

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
    rng, state = torch.get_rng_state(), putback_state.torch_state()

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
    assert torch.equal(torch.get_rng_state(), rng) and putback_state.torch_state() == state


# ----- dtypes and losses against hand-written loops --------------------------------------


# ----- set() and restore() are all-or-nothing: errors and interrupts at any line --------------


def _round_trip(wb):
    """The calls the sweep interrupts, in order."""
    return [lambda: wb.set(mode="bf16-true"), lambda: wb.set(mode="32-true", tf32=True),
            lambda: wb.set(mode="16-mixed"), lambda: wb.restore()]


def _view(wb):
    return (weights(wb.model), opt_state(wb.optimizer), wb.mode.name, str(wb.device), wb.tf32,
            len(wb.history), None if wb.scaler is None else wb.scaler.get_scale())


def _same_view(a, b) -> bool:
    return same(a[0], b[0]) and same_opt(a[1], b[1]) and a[2:] == b[2:]


def _stepped():
    wb = Workbench(*make())
    wb.step()
    return wb


def test_an_interrupt_at_any_line_of_set_or_restore_leaves_the_workbench_as_before():
    state = putback_state.torch_state()
    wb = _stepped()
    views = [_view(wb)]
    for call in _round_trip(wb):
        call()
        views.append(_view(wb))
    n, interrupted, start = 1, 0, _stepped()
    while True:
        wb = copy.deepcopy(start)  # a fresh copy of the same Workbench (cheaper than a new one)
        calls, done = _round_trip(wb), 0
        with InterruptAt(n) as sweep:
            try:
                for call in calls:
                    call()
                    done += 1
            except KeyboardInterrupt:
                interrupted += 1
        if not sweep.fired:
            break
        assert consistent(wb), n
        assert _same_view(_view(wb), views[done]), (n, done)  # the interrupted call left nothing
        assert putback_state.torch_state() == state
        if n % 10 == 0:  # and it still works: back to the exact start weights
            wb.set(mode="32-true")
            assert same(weights(wb.model), views[0][0]) or done >= 3
        n += 1
    assert interrupted > 50  # the sweep reached every line of the round trip


def test_a_failing_conversion_is_rolled_back():
    wb = _stepped()
    before = _view(wb)
    mode = get_mode("bf16-true")
    real = type(mode).convert_module

    def half_done(self, module):
        real(self, module)  # the weights are already bf16 when it fails
        raise RuntimeError("conversion failed")

    type(mode).convert_module = half_done
    try:
        with pytest.raises(RuntimeError, match="conversion failed"):
            wb.set(mode="bf16-true")
    finally:
        type(mode).convert_module = real
    assert consistent(wb) and _same_view(_view(wb), before)
    assert wb.step().param_dtype == torch.float32
