"""CPU features decide native fp16/bf16 support; they are injected, so no test depends on the CPU."""

from __future__ import annotations

import pytest
import torch

from ampnb import cpu as cpu_module
from ampnb.device import (
    cpu_features,
    cpu_features_as,
    devices,
    matmul_throughput,
    support,
    support_table,
)
from ampnb.formats import FORMATS
from ampnb.modes import MODES, get_mode

# (flags, native bf16, native fp16): x86 and ARM spellings, both answers for each format.
CPUS = {
    "avx2 only": ({"avx2", "fma"}, False, False),
    "avx512 without bf16": ({"avx2", "avx512f", "avx512bw"}, False, False),
    "avx512-bf16": ({"avx2", "avx512f", "avx512_bf16"}, True, False),
    "amx-bf16": ({"avx2", "amx_tile", "amx_bf16"}, True, False),
    "avx512-fp16": ({"avx2", "avx512f", "avx512_fp16"}, False, True),
    "sapphire rapids": ({"avx512_bf16", "avx512_fp16", "amx_bf16"}, True, True),
    "arm fp16": ({"asimd", "asimdhp"}, False, True),
    "arm bf16+fp16": ({"asimd", "asimdhp", "bf16"}, True, True),
}


@pytest.fixture(params=list(CPUS))
def cpu(request):
    flags, bf16, fp16 = CPUS[request.param]
    with cpu_features_as(flags):
        yield {"bf16": bf16, "fp16": fp16}


def test_format_support_follows_the_features(cpu):
    for name, native in cpu.items():
        found = support(name, "cpu")
        assert found.ok and found.native == native
        assert found.text == ("yes (native)" if native
                              else f"yes (slow: no native {name} units on this CPU)")
    for name in ("fp32", "fp64"):  # every CPU computes these natively
        assert support(name, "cpu").native


def test_mode_support_follows_the_features(cpu):
    for name, mode in MODES.items():
        found, available = support(name, "cpu"), mode.availability("cpu")
        assert found.ok == available.ok
        fmt = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(mode.compute_dtype)
        expected = not available.reason and (fmt is None or cpu[fmt])
        assert found.native == expected, name


def test_the_table_follows_the_features(cpu):
    table = support_table()
    cpu_column = [d.name for d in devices()].index("cpu") + 1
    rows = {row[0]: row[cpu_column] for row in table.rows}
    assert list(rows) == [*MODES, *FORMATS]
    for name in ("bf16", "fp16", "bf16-mixed", "bf16-true", "16-mixed", "16-true"):
        fmt = "bf16" if name.startswith("bf16") else "fp16"
        assert (rows[name] == "yes (native)") == cpu[fmt], name
    assert rows["transformer-engine"].startswith("yes (emulated")
    assert any("(injected, not this CPU's)" in note for note in table.notes)


def test_throughput_size_follows_the_features_and_its_cache_too(cpu):
    t = matmul_throughput("cpu", "bf16", n=64)
    assert (t.n, t.note == "") == ((64, True) if cpu["bf16"] else (16, False))


def test_injection_is_undone_after_the_block_and_on_error():
    detected = cpu_features()
    assert detected == cpu_module.detected_features()
    with pytest.raises(KeyError), cpu_features_as({"avx512_bf16"}) as inner:
        assert cpu_features() == inner == frozenset({"avx512_bf16"})
        with cpu_features_as(()):
            assert cpu_features() == frozenset()
            assert not support("bf16", "cpu").native
        assert support("bf16", "cpu").native
        raise KeyError("user code")
    assert cpu_features() == detected
    assert not any("injected" in note for note in support_table().notes)


def test_a_string_of_flags_is_refused():
    with pytest.raises(ValueError, match="iterable of flag names, got the string 'avx512_bf16'"):
        with cpu_features_as("avx512_bf16"):
            pass


def test_detection_reads_cpuinfo_once_and_adds_torchs_fp16_probe():
    found = cpu_module.detected_features()
    assert cpu_module.detected_features() is found  # cached: /proc/cpuinfo is read once
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", None)
    if probe is not None:
        assert ("mkldnn_fp16" in found) == bool(probe())


def test_the_fp8_modes_are_emulated_on_any_cpu(cpu):
    for name in ("transformer-engine", "transformer-engine-float16"):
        found = support(name, "cpu")
        assert found.ok and not found.native
        assert found.reason == get_mode(name).availability("cpu").reason
