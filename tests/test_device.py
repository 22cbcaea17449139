"""ampnb.device: devices, support against what torch really runs, throughput records."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ampnb import putback_state
from ampnb.device import (
    DeviceInfo,
    Support,
    cpu_features_as,
    devices,
    get_device,
    matmul_throughput,
    support,
    support_table,
    tf32,
    tf32_effect,
    throughput_table,
)
from ampnb.formats import FORMATS, get_format
from ampnb.modes import MODES, get_mode

CUDA = torch.cuda.is_available()
no_cuda_only = pytest.mark.skipif(CUDA, reason="checks the message for a missing GPU")
cuda_only = pytest.mark.skipif(not CUDA, reason="needs CUDA")


# ---------------------------------------------------------------- devices


def test_devices_match_what_torch_reports():
    found = devices()
    assert found[0] == DeviceInfo(found[0].name, "cpu", found[0].label, None)
    assert found[0].name == "cpu"
    cuda = [d for d in found if d.type == "cuda"]
    assert len(cuda) == (torch.cuda.device_count() if CUDA else 0)
    for i, d in enumerate(cuda):
        assert d.name == f"cuda:{i}"
        assert d.capability == torch.cuda.get_device_capability(i)
        assert d.label == torch.cuda.get_device_name(i)
    assert any(d.type == "mps" for d in found) == torch.backends.mps.is_available()


def test_devices_are_frozen_and_the_list_is_a_copy():
    found = devices()
    with pytest.raises(dataclasses.FrozenInstanceError):
        found[0].name = "gpu"
    found.clear()
    assert devices()[0].name == "cpu"


@pytest.mark.parametrize("spelling", ["cpu", "CPU", torch.device("cpu"), "cpu:0"])
def test_get_device_accepts_names_and_torch_devices(spelling):
    try:
        torch.device(spelling)
    except RuntimeError:
        pytest.skip(f"this torch does not parse {spelling!r}")
    assert get_device(spelling) == devices()[0]


def test_get_device_accepts_a_device_info():
    assert get_device(devices()[0]) is devices()[0]


@no_cuda_only
def test_missing_cuda_names_it_and_lists_what_is_there():
    names = ", ".join(d.name for d in devices())
    with pytest.raises(ValueError) as err:
        get_device("cuda")
    assert str(err.value) == f"device 'cuda' is not available on this machine; available: {names}"
    with pytest.raises(ValueError, match="'cuda:1' is not available"):
        get_device(torch.device("cuda:1"))


@pytest.mark.parametrize("bad", ["cpu:5", "cpu:1", torch.device("cpu", 3)])
def test_a_cpu_index_other_than_0_is_refused_naming_the_devices(bad):
    names = ", ".join(d.name for d in devices())
    with pytest.raises(ValueError) as err:
        get_device(bad)
    assert str(err.value) == f"device {str(bad)!r} is not available on this machine; available: {names}"


def test_the_magics_device_option_refuses_cpu_1_too():
    pytest.importorskip("IPython")
    from ampnb.magics.runs import device_name

    with pytest.raises(ValueError, match="device 'cpu:1' is not available on this machine"):
        device_name("cpu:1")
    assert device_name("cpu:0") == "cpu"


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "", None, 3.5])
def test_unknown_device_is_a_one_line_value_error(bad):
    with pytest.raises(ValueError, match="available: cpu") as err:
        get_device(bad)
    assert "\n" not in str(err.value)


@cuda_only
def test_plain_cuda_means_the_current_gpu():
    assert get_device("cuda").name == f"cuda:{torch.cuda.current_device()}"


# ---------------------------------------------------------------- support


@pytest.mark.parametrize("name", list(FORMATS))
def test_format_support_on_cpu_agrees_with_torch(name):
    f, found = get_format(name), support(name, "cpu")
    assert isinstance(found, Support) and found.reason == found.reason.strip()
    if f.torch_dtype is None or not f.storage:
        assert not found.ok and found.reason  # tf32 is a CUDA mode, fp4 has no dtype
        return
    assert found.ok
    x = torch.tensor([1.5, -0.25, 3.0])
    assert torch.equal(x.to(f.torch_dtype).float(), x)  # exact in every format: torch casts it
    if f.bits >= 16:  # ok means torch computes in it here
        y = x.to(f.torch_dtype).reshape(1, 3) @ x.to(f.torch_dtype).reshape(3, 1)
        assert y.dtype == f.torch_dtype and y.item() == pytest.approx(x.dot(x).item())
    if f.bits == 8:
        assert not found.native  # no CPU has FP8 matmul units


def test_native_fp16_on_cpu_follows_torchs_own_probe():
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", None)
    if probe is None:
        pytest.skip("this torch has no fp16 CPU probe")
    assert support("fp16", "cpu").native == bool(probe())


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp32", "fp64"])
def test_slow_means_supported_but_not_native(name):
    found = support(name, "cpu")
    assert found.ok
    assert found.text == ("yes (native)" if found.native else f"yes ({found.reason})")
    if not found.native:
        assert found.reason.startswith("slow: no native")


# A CPU with native bf16 and fp16 units, one with neither, and each alone: no test may depend
# on which CPU runs it, so the answers are injected (x86 and ARM spellings of the flags).
CPUS = {
    "avx2 only": {"avx2", "fma"},
    "avx512-bf16": {"avx2", "avx512f", "avx512_bf16"},
    "avx512-fp16": {"avx2", "avx512f", "avx512_fp16"},
    "arm bf16+fp16": {"asimd", "asimdhp", "bf16"},
}


@pytest.mark.parametrize("cpu", list(CPUS))
@pytest.mark.parametrize("name", list(MODES))
def test_mode_support_agrees_with_the_mode_and_really_runs(name, cpu):
    mode = get_mode(name)
    with cpu_features_as(CPUS[cpu]):
        found = support(mode, "cpu")
        compute = support(mode.compute_dtype, "cpu")
    available = mode.availability("cpu")
    assert found.ok == available.ok
    if not found.ok:
        assert found.text == f"no: {available.reason}"
        return
    torch.manual_seed(0)
    with mode.module_init_context():
        model = mode.convert_module(torch.nn.Linear(4, 3))
    with mode.forward_context("cpu"):
        y = model(mode.convert_input(torch.randn(2, 4)))
    assert y.dtype == mode.compute_dtype
    # A mode that says how it runs (FP8 emulated) is not native, whatever the CPU has for its
    # compute dtype; otherwise it is exactly as native as that dtype.
    assert found.native == (not available.reason and compute.native)
    if available.reason:
        assert found.reason == available.reason


def test_spellings_of_the_same_thing_agree():
    assert support("16-mixed") == support(16) == support(get_mode("16-mixed"))
    assert support("bf16") == support(torch.bfloat16) == support(get_format("bf16"))
    assert support("BF16-Mixed") == support("bf16-mixed")


def test_unknown_mode_or_format_lists_both():
    with pytest.raises(ValueError, match="unknown mode or format 'fp7'; modes: 32-true") as err:
        support("fp7")
    assert "formats: fp64" in str(err.value) and "\n" not in str(err.value)


def test_support_on_a_bad_device_name_raises():
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        support("fp16", "tpu")


@no_cuda_only
def test_support_on_absent_cuda_says_what_is_missing():
    found = support("bf16-mixed", "cuda")
    assert not found.ok and found.reason == "needs CUDA, which this machine does not have"
    assert found.text == "no: needs CUDA, which this machine does not have"


@cuda_only
def test_cuda_support_follows_compute_capability():
    dev = get_device("cuda")
    assert support("bf16", dev).native == (dev.capability >= (8, 0)) == support("tf32", dev).ok
    assert support("bf16", dev).ok  # below 8.0 torch runs bf16 without bf16 units: emulated
    assert support("fp8_e4m3", dev).native == (dev.capability >= (8, 9))
    assert support("bf16-mixed", dev).ok == get_mode("bf16-mixed").availability(dev.name).ok


def test_support_table_has_every_mode_then_every_format():
    table = support_table()
    present = devices()
    measured = ["mode / format", *(d.name for d in present)]
    assert list(table.headers[:len(measured)]) == measured  # then the spec columns
    assert [row[0] for row in table.rows] == [*MODES, *FORMATS]
    for row in table.rows:
        assert list(row[1:len(measured)]) == [support(row[0], d).text for d in present]
    html = table._repr_html_()
    assert all(name in html for name in MODES)
    assert repr(table) == repr(support_table())  # deterministic for nbval


# ---------------------------------------------------------------- TF32 effect on this device


def test_tf32_has_no_effect_on_cpu_matmuls():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(96, 200, generator=gen), torch.randn(200, 64, generator=gen)
    reference = a @ b
    with tf32(True):
        on = a @ b
    assert torch.equal(on, reference)
    assert "no effect on cpu" in tf32_effect("cpu")


@cuda_only
def test_tf32_changes_cuda_matmuls_only_on_ampere_or_newer():
    dev = get_device("cuda")
    gen = torch.Generator(device=dev.name).manual_seed(0)
    a = torch.randn(512, 2048, generator=gen, device=dev.name)
    b = torch.randn(2048, 512, generator=gen, device=dev.name)
    exact = (a.double() @ b.double()).float()
    with tf32(False):
        off = (a @ b - exact).abs().max().item()
    with tf32(True):
        on = (a @ b - exact).abs().max().item()
    if dev.capability >= (8, 0):
        assert on > 10 * off  # 10-bit mantissa inputs vs 23-bit
        assert "is off" in tf32_effect(dev) and "no effect" not in tf32_effect(dev)
    else:
        assert on == off and "no effect" in tf32_effect(dev)


# ---------------------------------------------------------------- throughput


def test_throughput_is_positive_derived_and_cached():
    before_rng, before = torch.get_rng_state(), putback_state.torch_state()
    t = matmul_throughput("cpu", "fp32", n=64)
    assert t.device == "cpu" and t.dtype == "fp32" and t.n == 64 and t.note == ""
    assert t.seconds > 0 and t.tflops > 0
    assert t.tflops == pytest.approx(2 * 64**3 / t.seconds / 1e12)
    assert matmul_throughput("cpu", torch.float32, n=64) is t
    assert matmul_throughput("cpu", "fp32", n=64, refresh=True) is not t
    assert torch.equal(torch.get_rng_state(), before_rng)  # its own generator, not the user's
    assert putback_state.torch_state() == before


def test_throughput_record_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        matmul_throughput("cpu", "fp32", n=64).tflops = 1.0


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_slow_cpu_formats_are_measured_smaller_and_say_so(name):
    t = matmul_throughput("cpu", name, n=128)
    if support(name, "cpu").native:
        assert t.n == 128 and t.note == ""
    else:
        assert t.n == 32 and "instead of 128" in t.note and "slow" in t.note
    assert t.tflops > 0


@pytest.mark.parametrize(("args", "match"), [
    (("cpu", "fp8_e4m3", 64), "measures fp64, fp32, tf32, bf16, fp16"),
    (("cpu", "fp32", 8), "n must be an int >= 16"),
    (("cpu", "fp32", 64.0), "n must be an int >= 16"),
    (("cpu", "fp9", 64), "Unknown float format 'fp9'"),
    (("tpu", "fp32", 64), "unknown device 'tpu'"),
])
def test_throughput_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        matmul_throughput(*args)


def test_throughput_of_tf32_on_cpu_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="tf32 matmul does not run on cpu: needs CUDA"):
        matmul_throughput("cpu", "tf32", 64)


def test_throughput_table_rows_per_device():
    table = throughput_table("cpu")
    assert [row[1] for row in table.rows] == ["fp32", "bf16", "fp16"]
    for row in table.rows:
        t = matmul_throughput("cpu", row[1])  # the cached record the table shows
        assert row[2] == t.n and row[4] == f"{t.tflops:.3g}"
    assert table.rows[0][5] == "1.00x"


@pytest.mark.parametrize("name", ["transformer-engine", "transformer-engine-float16"])
def test_support_of_a_mode_that_runs_emulated_says_so(name):
    found = get_mode(name).availability("cpu")
    shown = support(name, "cpu")
    assert found.ok and shown.ok
    if found.reason:  # emulated here (no Transformer Engine on a Hopper GPU)
        assert not shown.native and shown.reason == found.reason
