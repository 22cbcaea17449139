"""Emulated fp16 kernels: fp32 kernels on fp16 inputs, rounded once, as tensor cores compute."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampnb import putback_state
from ampnb.fp16_kernels import EMULATED, Fp16KernelEmulation, emulated_fp16_kernels

FP16_ULP_AT_1 = torch.finfo(torch.float16).eps


def _ulps(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Distance in fp16 units in the last place (at the reference's magnitude)."""
    ref16 = ref.to(torch.float16).double()
    spacing = torch.where(ref16 == 0, torch.tensor(2.0**-24, dtype=torch.float64),
                          ref16.abs() * FP16_ULP_AT_1)
    spacing = torch.maximum(spacing, torch.tensor(2.0**-24, dtype=torch.float64))
    return (got.double() - ref16).abs() / spacing


def _inputs(kind: str, shape_a, shape_b, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(*shape_a, generator=g), torch.randn(*shape_b, generator=g)
    if kind == "wide":  # magnitudes over many binades, cancellation in the sums
        a = a * torch.exp2(torch.randint(-10, 6, shape_a, generator=g).float())
        b = b * torch.exp2(torch.randint(-10, 6, shape_b, generator=g).float())
    return a.half(), b.half()


@pytest.mark.parametrize("kind", ["random", "wide"])
@pytest.mark.parametrize("op", ["mm", "bmm", "addmm", "baddbmm"])
def test_product_equals_fp64_product_rounded_once(op, kind):
    if op in ("mm", "addmm"):
        a, b = _inputs(kind, (48, 96), (96, 40))
    else:
        a, b = _inputs(kind, (3, 48, 96), (3, 96, 40))
    c = torch.randn(a.shape[:-1] + b.shape[-1:], generator=torch.Generator().manual_seed(9)).half()
    call = {"mm": lambda x, y: torch.mm(x, y), "bmm": lambda x, y: torch.bmm(x, y),
            "addmm": lambda x, y: torch.addmm(c, x, y),
            "baddbmm": lambda x, y: torch.baddbmm(c, x, y)}[op]
    with emulated_fp16_kernels() as mode:
        got = call(a, b)
    assert mode.emulated_ops == 1 and got.dtype == torch.float16
    exact = call(a.double(), b.double()) if op in ("mm", "bmm") else (
        c.double() + (torch.mm if op == "addmm" else torch.bmm)(a.double(), b.double()))
    # one rounding of the exact result; fp32 accumulation order may move it by one unit
    assert _ulps(got, exact).max() <= 1
    assert (got.double() == exact.half().double()).float().mean() > 0.95


def test_overflow_to_inf_exactly_where_the_native_kernel_overflows():
    fmax = torch.finfo(torch.float16).max
    a = torch.full((4, 2), 200.0).half()
    b = torch.tensor([[200.0, -200.0, 100.0, 1.0], [200.0, -200.0, 100.0, 1.0]]).half()
    native = torch.mm(a, b)
    with emulated_fp16_kernels():
        emulated = torch.mm(a, b)
    exact = torch.mm(a.double(), b.double())
    assert torch.equal(torch.isinf(emulated), torch.isinf(native))
    assert torch.equal(torch.isinf(emulated), exact.abs() > fmax)
    assert torch.isinf(emulated).any() and torch.isfinite(emulated).any()


def test_only_fp16_calls_are_emulated_and_other_dtypes_are_untouched():
    a = torch.randn(8, 8)
    with emulated_fp16_kernels() as mode:
        out = torch.mm(a, a)
        low = torch.mm(a.bfloat16(), a.bfloat16())
    assert mode.emulated_ops == 0
    assert torch.equal(out, torch.mm(a, a)) and torch.equal(low, torch.mm(a.bfloat16(), a.bfloat16()))


def test_output_dtypes_are_those_of_the_native_kernel():
    """Results come back in the dtype the fp16 kernel returns (conv grads, attention stats)."""
    conv = nn.Conv2d(3, 4, 3).half()
    x = torch.randn(2, 3, 8, 8).half().requires_grad_()
    with emulated_fp16_kernels() as mode:
        y = conv(x)
        y.float().sum().backward()
    assert y.dtype == torch.float16 and x.grad.dtype == torch.float16
    assert conv.weight.grad.dtype == torch.float16 and mode.emulated_ops >= 2


def test_lstm_under_16_mixed_runs_emulated():
    """oneDNN's fp16 LSTM kernel is refused on many CPUs; the emulated one always runs."""
    torch.manual_seed(0)
    lstm = nn.LSTM(8, 8, batch_first=True)
    x = torch.randn(2, 5, 8)
    with emulated_fp16_kernels():  # around backward too: its kernels are fp16 as well
        with torch.autocast("cpu", dtype=torch.float16):
            out, _ = lstm(x)
        out.float().sum().backward()
    ref, _ = lstm(x)
    assert out.dtype == torch.float16
    assert torch.allclose(out.float(), ref, atol=5e-3)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in lstm.parameters())


def test_state_is_restored_also_when_the_body_raises():
    before = putback_state.torch_state()
    with pytest.raises(ZeroDivisionError), emulated_fp16_kernels():
        raise ZeroDivisionError
    assert putback_state.torch_state() == before


def _cpu_kernel(op) -> str:
    return repr(torch.library.get_kernel(op, "CPU"))


def test_only_the_emulated_ops_kernels_are_overridden_and_all_are_handed_back():
    """Every other op stays in C++ (a Python dispatch mode made the demo GPT's step 2x slower)."""
    assert all(isinstance(op, torch._ops.OpOverload) for op in EMULATED)
    others = [torch.ops.aten.add.Tensor, torch.ops.aten.mul.Tensor, torch.ops.aten._to_copy.default,
              torch.ops.aten.mm.out, torch.ops.aten.gelu.default]
    before = {op: _cpu_kernel(op) for op in (*EMULATED, *others)}
    with emulated_fp16_kernels():
        assert all(_cpu_kernel(op) != before[op] for op in EMULATED)
        assert all(_cpu_kernel(op) == before[op] for op in others)
        with emulated_fp16_kernels() as inner:  # nested: the inner one wraps the outer one
            a = torch.randn(4, 4).half()
            assert torch.equal(torch.mm(a, a), torch.mm(a.float(), a.float()).half())
            assert inner.emulated_ops == 1
    assert all(_cpu_kernel(op) == before[op] for op in (*EMULATED, *others))


def test_an_emulation_cannot_be_entered_twice():
    before, emulation = putback_state.torch_state(), Fp16KernelEmulation()
    with emulation:
        assert putback_state.torch_state().product_kernels != before.product_kernels  # the check sees it
        with pytest.raises(RuntimeError, match="already entered"):
            emulation.__enter__()
    assert putback_state.torch_state() == before


def _train_16_mixed(name: str, emulate: bool, steps: int) -> tuple[list[float], list[float]]:
    """A plain torch.amp 16-mixed loop with a CPU GradScaler; losses and the scale history."""
    from ampnb.models import demo

    model, opt, loss_fn, batches = demo(name)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    losses, scales = [], []
    with emulated_fp16_kernels(emulate):
        for i in range(steps):
            x, y = batches[i % len(batches)]
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
            scales.append(scaler.get_scale())
    return losses, scales


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt"])
def test_a_16_mixed_training_run_matches_the_native_kernels_within_fp16_rounding(name):
    """50 steps of each demo model: same scale history (so the same skipped steps), same losses.

    Only the rounding order of the sums differs. The GPT's training amplifies such differences
    (as any two accumulation orders do): its steps agree to a few fp16 units at first, then
    drift apart slowly (about 1% by step 50 here; the bound is 5%).
    """
    native_loss, native_scale = _train_16_mixed(name, emulate=False, steps=50)
    emul_loss, emul_scale = _train_16_mixed(name, emulate=True, steps=50)
    assert emul_scale == native_scale
    rel = [abs(a - b) / abs(a) for a, b in zip(native_loss, emul_loss)]
    assert max(rel[:5]) < 1e-3  # a few fp16 units
    assert max(rel) < (5e-2 if name == "gpt" else 2e-3)
    assert native_loss[-1] < native_loss[0] and emul_loss[-1] < emul_loss[0]


def test_auto_emulates_exactly_where_the_cpu_has_no_fp16_units():
    from ampnb.device import cpu_features_as
    from ampnb.fp16_kernels import emulates_fp16, fp16_kernels_note

    with cpu_features_as({"avx2"}):
        assert emulates_fp16("cpu") and emulates_fp16("cpu", "auto")
        assert not emulates_fp16("cpu", "native")
        assert "emulated in fp32" in fp16_kernels_note("cpu")
        assert "native" in fp16_kernels_note("cpu", "native")
    with cpu_features_as({"avx512_fp16"}):
        assert not emulates_fp16("cpu") and emulates_fp16("cpu", "emulated")
        assert fp16_kernels_note("cpu") == "fp16 kernels native (this CPU has fp16 units)"
    assert not emulates_fp16("cuda", "emulated") and fp16_kernels_note("cuda") == ""


def test_the_python_switch_sets_the_default_and_bad_values_are_refused():
    from ampnb import set_fp16_kernels
    from ampnb.device import cpu_features_as
    from ampnb.fp16_kernels import emulates_fp16, fp16_kernels_choice
    from ampnb.modes import get_mode

    with cpu_features_as({"avx2"}):
        old = set_fp16_kernels("native")
        try:
            assert fp16_kernels_choice() == "native" and not emulates_fp16("cpu")
            with get_mode("16-mixed").kernel_context("cpu") as mode:
                assert mode is None  # nothing pushed: native kernels
            with get_mode("16-mixed").kernel_context("cpu", "emulated") as mode:
                assert isinstance(mode, Fp16KernelEmulation)
        finally:
            set_fp16_kernels(old)
    with pytest.raises(ValueError, match="fp16_kernels='gpu' is not allowed; allowed: auto, native, emulated"):
        set_fp16_kernels("gpu")
    assert fp16_kernels_choice() == old


def test_the_support_table_labels_fp16_modes_with_the_measured_slowdown():
    from ampnb.device import cpu_features_as, support
    from ampnb.fp16_kernels import native_slowdown

    with cpu_features_as({"avx2"}):
        found = support("16-mixed", "cpu")
        assert found.ok and not found.native
        assert f"native fp16 kernels here are {native_slowdown():.0f}× slower" in found.reason
        assert "emulated" not in support("bf16-mixed", "cpu").reason
    with cpu_features_as({"avx512_fp16"}):
        assert support("16-mixed", "cpu").native


def test_blocks_may_end_in_any_order():
    """Two emulations (threads, generators) ending oldest first: the newer one still works,
    and torch's kernels are back once both ended (one override per op, shared)."""
    before = {op: _cpu_kernel(op) for op in EMULATED}
    a = torch.randn(5, 5).half()
    older, newer = Fp16KernelEmulation(), Fp16KernelEmulation()
    older.__enter__()
    newer.__enter__()
    older.__exit__(None, None, None)
    try:
        assert torch.equal(torch.mm(a, a), torch.mm(a.float(), a.float()).half())
        assert newer.emulated_ops == 1 and older.emulated_ops == 0
    finally:
        newer.__exit__(None, None, None)
    assert {op: _cpu_kernel(op) for op in EMULATED} == before


def _small_step(monkeypatch, kernels: bool):
    """A conv + linear forward and backward under fp16 emulation, then a TF32-emulated product,
    with the override running as torch.library kernels or (torch < 2.9) a dispatch mode."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from ampnb import _kernels
    from ampnb.device import tf32_context

    monkeypatch.setattr(_kernels, "_GET_KERNEL", kernels)
    torch.manual_seed(0)
    conv, lin = nn.Conv2d(3, 4, 3).half(), nn.Linear(36, 5).half()
    x = torch.randn(2, 3, 8, 8).half().requires_grad_()
    before = putback_state.torch_state()
    with emulated_fp16_kernels() as emulation:
        assert bool(_get_current_dispatch_mode_stack()) is not kernels
        y = lin(conv(x).flatten(1)[:, :36])
        y.float().sum().backward()
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    with tf32_context("emulate") as tf32:
        z = a @ b
    assert putback_state.torch_state() == before
    assert emulation.emulated_ops >= 4 and tf32.rounded_ops == 1
    return [y, x.grad, conv.weight.grad, lin.weight.grad, z]


def test_the_dispatch_mode_fallback_for_older_torch_computes_exactly_the_same(monkeypatch):
    from ampnb.formats import quantize

    got = _small_step(monkeypatch, kernels=True)
    old = _small_step(monkeypatch, kernels=False)
    assert all(torch.equal(g, o) and g.dtype == o.dtype for g, o in zip(got, old))
    # and both are the fp32 kernels on the fp16 values, each result rounded once
    torch.manual_seed(0)
    conv, lin = nn.Conv2d(3, 4, 3).half(), nn.Linear(36, 5).half()
    x = torch.randn(2, 3, 8, 8).half()
    c = nn.functional.conv2d(x.float(), conv.weight.float(), conv.bias.float()).half()
    y = nn.functional.linear(c.flatten(1)[:, :36].float(), lin.weight.float(),
                             lin.bias.float()).half()
    assert torch.equal(got[0], y)
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    assert torch.equal(got[4], quantize(a, "tf32") @ quantize(b, "tf32"))
