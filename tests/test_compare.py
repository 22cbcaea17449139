"""compare(): rows, errors against an independent computation, state and RNG left as found."""

from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch

from ampnb import putback_state
from ampnb.comparison import Comparison, Work, compare, errors, leaves
from ampnb.formats import quantize


def _linear(seed: int = 0) -> tuple[torch.nn.Linear, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(16, 8)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(8, 16, generator=g))
        lin.bias.copy_(torch.randn(8, generator=g))
    return lin, torch.randn(4, 16, generator=g)


def test_rows_reference_first_and_speedup_is_ratio_of_medians():
    lin, x = _linear()
    c = compare(lambda: lin(x), ["bf16-mixed"], repeat=3)
    assert isinstance(c, Comparison)
    assert c.labels == ("32-true", "bf16-mixed")
    assert c.reference.speedup == 1.0
    r = c.row("bf16")
    assert len(r.times) == 3
    assert r.seconds == sorted(r.times)[1]
    assert r.speedup == pytest.approx(c.reference.seconds / r.seconds)


def test_errors_match_an_independent_autocast_computation():
    lin, x = _linear()
    c = compare(lambda: lin(x), "bf16-mixed,16-mixed", repeat=1)
    y32 = lin(x).detach().double()
    for mode, dtype in (("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16)):
        with torch.autocast("cpu", dtype=dtype):
            y = lin(x).detach()
        assert y.dtype == dtype
        d = y.double() - y32
        row = c.row(mode)
        assert row.max_abs_error == d.abs().max().item() > 0
        assert row.rel_error == pytest.approx((d.norm() / y32.norm()).item())
        assert row.result_dtypes == (str(dtype).removeprefix("torch."),)
    assert c.reference.max_abs_error == 0 and c.reference.result_dtypes == ("float32",)


def test_true_mode_creates_tensors_in_its_dtype():
    c = compare(lambda: torch.full((3,), 1 / 3), ["16-true", "bf16-true"], repeat=1)
    third = torch.full((3,), 1 / 3)
    for mode, fmt in (("16-true", "fp16"), ("bf16-true", "bf16")):
        assert c.row(mode).result_dtypes == ({"fp16": "float16", "bf16": "bfloat16"}[fmt],)
        expected = (quantize(third, fmt) - third).abs().max().item()
        assert c.row(mode).max_abs_error == pytest.approx(expected, rel=1e-6)


def test_tf32_emulation_error_matches_quantized_inputs():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(32, 64, generator=g), torch.randn(64, 16, generator=g)
    c = compare(lambda: a @ b, ["32-true"], tf32="emulate", repeat=1)
    assert c.labels == ("32-true", "32-true + TF32 emulate")
    expected = (quantize(a, "tf32") @ quantize(b, "tf32")).double() - (a @ b).double()
    assert c.row("32-true").max_abs_error == pytest.approx(expected.abs().max().item(), rel=1e-9)
    assert c.reference.max_abs_error == 0


def test_every_run_gets_the_same_seed_and_rng_state_is_restored():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    c = compare(lambda: torch.randn(5), ["bf16-mixed"], repeat=2)
    assert torch.equal(torch.get_rng_state(), before)
    assert c.row("bf16-mixed").max_abs_error == 0  # randn is not lowered by autocast


def test_prepare_and_restore_around_every_run():
    calls = []

    def prepare(mode):
        calls.append(("prepare", mode.name))
        return ""

    work = Work(run=lambda: calls.append("run"), prepare=prepare,
                restore=lambda: calls.append("restore"))
    seen = []
    compare(work, ["bf16-mixed"], repeat=2, warmup=2, progress=lambda *a: seen.append(a))
    runs = 2 * (2 + 2)
    assert calls.count("run") == calls.count("restore") == runs
    assert calls[:3] == [("prepare", "32-true"), "run", "restore"]
    assert [c for c in calls if isinstance(c, tuple)].count(("prepare", "bf16-mixed")) == 4
    assert [s[:2] for s in seen] == [(i, runs) for i in range(1, runs + 1)]


def test_saved_activation_bytes_match_saved_tensors_hooks():
    lin, x = _linear()

    def saved(dtype):
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            lin(x)
        return sum(seen.values())

    c = compare(lambda: lin(x), ["bf16-mixed"], repeat=1)
    assert c.reference.saved_bytes == saved(None) > 0
    assert c.row("bf16-mixed").saved_bytes == saved(torch.bfloat16)
    assert c.reference.peak_bytes is None  # CUDA only


def test_a_failing_mode_gets_a_failed_row_and_the_others_are_measured():
    before = putback_state.torch_state()
    lin, x = _linear()

    def work():
        if torch.get_autocast_dtype("cpu") == torch.float16 and torch.is_autocast_enabled("cpu"):
            raise RuntimeError("oneDNN refuses fp16\nsecond line of the message")
        return lin(x)

    c = compare(work, ["16-mixed", "bf16-mixed"], tf32="emulate", repeat=2)
    assert putback_state.torch_state() == before
    assert c.labels == ("32-true", "16-mixed + TF32 emulate", "bf16-mixed + TF32 emulate")
    bad = c.row("16-mixed")
    line = work.__code__.co_firstlineno + 2  # the raise: the row says where the user's code raised
    assert bad.failed and bad.note == (f"failed: RuntimeError: oneDNN refuses fp16 "
                                       f"(at work, test_compare.py:{line})")
    assert bad.times == () and math.isnan(bad.seconds)
    good = c.row("bf16-mixed")
    assert not good.failed and len(good.times) == 2 and good.result_dtypes == ("bfloat16",)
    text = repr(c)
    assert "failed: RuntimeError: oneDNN refuses fp16" in text and "second line" not in text


def test_a_failing_reference_raises_and_restores_state():
    before = putback_state.torch_state()

    def boom():
        raise RuntimeError("boom in 32-true")

    with pytest.raises(RuntimeError, match="boom"):
        compare(boom, ["16-true"], tf32="emulate", repeat=1)
    assert putback_state.torch_state() == before


def test_activation_bytes_are_memory_meters_and_exclude_parameters():
    from ampnb.instruments import memory_meter

    lin, x = _linear()
    x = x.requires_grad_()  # the input is a leaf too: only computed tensors are activations
    net = torch.nn.Sequential(lin, torch.nn.GELU(), torch.nn.Linear(8, 4))
    c = compare(lambda: net(x), ["bf16-mixed"], repeat=1)
    for mode, ctx in (("32-true", contextlib.nullcontext()),
                      ("bf16-mixed", torch.autocast("cpu", dtype=torch.bfloat16))):
        with memory_meter() as m, ctx:
            net(x)
        assert c.row(mode).saved_bytes == m.peak_bytes > 0
    params = sum(p.numel() * p.element_size() for p in net.parameters())
    with memory_meter() as m:
        net(x)
    # what autograd saved, hand-counted: the GELU input and the second Linear's input (fp32)
    assert m.peak_bytes == 2 * 4 * 8 * 4 and c.reference.saved_bytes != params + m.peak_bytes


def test_structured_results_are_compared_field_by_field():
    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor
        extra: dict

    ref = Out(torch.tensor([1.0, 2.0]), {"h": torch.tensor([3.0])})
    got = Out(torch.tensor([1.0, 2.5]), {"h": torch.tensor([3.0])})
    assert dict(leaves(ref, "out")).keys() == {"out.logits", "out.extra['h']"}
    assert errors(got, ref) == (0.5, pytest.approx(0.5 / math.sqrt(14)))
    pytest.importorskip("transformers")
    from transformers.modeling_outputs import CausalLMOutput

    a = CausalLMOutput(loss=torch.tensor(1.0), logits=torch.ones(2))
    b = CausalLMOutput(loss=torch.tensor(1.0), logits=torch.tensor([1.0, 0.75]))
    assert [k for k, _ in leaves(a, "out")] == ["out.loss", "out.logits"]
    assert errors(b, a)[0] == 0.25


def test_state_unchanged_after_compare():
    lin, x = _linear()
    before = putback_state.torch_state()
    compare(lambda: lin(x).sum().backward(), ["bf16-mixed", "64-true"], tf32="on", repeat=1)
    assert putback_state.torch_state() == before


@pytest.mark.parametrize("kwargs, match", [
    ({"modes": ["bf17-mixed"]}, "unknown precision mode 'bf17-mixed'"),
    ({"modes": []}, "at least one mode"),
    ({"repeat": 0}, "repeat must be an int >= 1"),
    ({"warmup": 0}, "warmup must be an int >= 1"),
    ({"tf32": "maybe"}, "tf32 must be one of"),
    ({"device": "gpu"}, "unknown device 'gpu'"),
])
def test_bad_input_is_a_one_line_value_error(kwargs, match):
    before = putback_state.torch_state()
    with pytest.raises(ValueError, match=match) as info:
        compare(lambda: torch.ones(1), **kwargs)
    assert "\n" not in str(info.value)
    assert putback_state.torch_state() == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_cuda_says_what_would_run_instead():
    with pytest.raises(ValueError, match="needs CUDA.*'cpu' instead"):
        compare(lambda: torch.ones(1), ["bf16-mixed"], device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_compare_measures_peak_memory():
    lin, x = _linear()
    lin, x = lin.cuda(), x.cuda()
    c = compare(lambda: lin(x), ["bf16-mixed"], device="cuda", repeat=2)
    assert c.reference.peak_bytes is not None and c.reference.peak_bytes >= 0
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = lin(x)
    assert c.row("bf16-mixed").max_abs_error == (y.double() - lin(x).double()).abs().max().item()


def test_errors_of_nested_results_and_nan():
    ref = {"a": torch.tensor([1.0, 2.0]), "b": [torch.tensor(4.0), 3]}
    got = {"a": torch.tensor([1.5, 2.0]), "b": [torch.tensor(4.0), 3]}
    worst, rel = errors(got, ref)
    assert worst == 0.5
    assert rel == pytest.approx(0.5 / math.sqrt(1 + 4 + 16 + 9))
    assert math.isnan(errors({"a": torch.tensor([math.nan, 2.0])}, ref)[0])
    assert math.isnan(errors("no tensors", ref)[0])


def test_table_renders_every_row():
    lin, x = _linear()
    c = compare(lambda: lin(x), ["bf16-mixed"], repeat=1)
    text, html = repr(c), c._repr_html_()
    for label in c.labels:
        assert label in text and label in html
    assert "max abs err" in text and "<table" in html


def _mlp_work():
    """A training-step-like work on a small MLP: the outputs and the weight gradients."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))

    def run():
        net.zero_grad(set_to_none=True)
        out = net(x)
        out.float().square().mean().backward()
        return {"out": out.detach().float(), "grad": net[0].weight.grad.clone()}

    return net, x, run


def test_compare_keep_fp32_equals_a_hand_written_fp32_region():
    net, x, run = _mlp_work()
    result = compare(run, ["bf16-mixed"], repeat=1, keep_fp32="2", model=net)
    net.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # compare runs the work as %%amp does:
        h = net[1](net[0](x))                           # all under autocast but backward
        with torch.autocast("cpu", enabled=False):
            out = net[2](h.float())
        loss = out.float().square().mean()
    loss.backward()
    expected = {"out": out.detach(), "grad": net[0].weight.grad}
    plain = compare(run, ["bf16-mixed"], repeat=1)
    row, ref = result.row("bf16-mixed"), result.reference
    assert "kept in fp32: 2" in row.note and "kept" not in ref.note
    assert (row.max_abs_error, row.rel_error) == errors(expected, {"out": _fp32(run)["out"],
                                                                   "grad": _fp32(run)["grad"]})
    assert row.rel_error != plain.row("bf16-mixed").rel_error


def _fp32(run):
    return run()


def test_compare_keep_fp32_needs_a_model_and_patterns_that_match():
    net, _, run = _mlp_work()
    with pytest.raises(ValueError, match="needs model="):
        compare(run, ["bf16-mixed"], repeat=1, keep_fp32="2")
    with pytest.raises(ValueError, match="matches no module"):
        compare(run, ["bf16-mixed"], repeat=1, keep_fp32="lm_head", model=net)
    with pytest.raises(ValueError, match="allowed: auto, native, emulated"):
        compare(run, ["16-mixed"], repeat=1, fp16_kernels="gpu")


@pytest.mark.parametrize("kernels", ["native", "emulated"])
def test_compare_16_mixed_runs_the_chosen_fp16_kernels_and_says_so(kernels):
    from ampnb.device import cpu_features_as
    from ampnb.fp16_kernels import emulated_fp16_kernels

    net, x, run = _mlp_work()
    with cpu_features_as({"avx2"}):  # the label as on a CPU without fp16 units
        result = compare(run, ["16-mixed"], repeat=1, fp16_kernels=kernels)
    net.zero_grad(set_to_none=True)
    with emulated_fp16_kernels(kernels == "emulated"):
        with torch.autocast("cpu", dtype=torch.float16):
            out = net(x)
            out.float().square().mean().backward()
    expected = {"out": out.detach().float(), "grad": net[0].weight.grad.clone()}
    row = result.row("16-mixed")
    assert (row.max_abs_error, row.rel_error) == errors(expected, _fp32(run))
    assert ("emulated in fp32" in row.note) == (kernels == "emulated")
    assert "slower" in row.note


def test_compare_options_are_one_frozen_record_the_public_call_builds():
    import dataclasses

    from ampnb.comparison.run import CompareOptions, compare_with

    options = CompareOptions(repeat=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.repeat = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="repeat must be an int >= 1, got 0"):
        compare_with(lambda: None, options)
