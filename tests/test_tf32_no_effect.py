"""`ampnb.tf32(True)` / `set_tf32(True)` say once, as a warning, when no device here has TF32 units
(a CPU, a pre-Ampere GPU), as docs/devices.md promises; where TF32 is real they say nothing."""

from __future__ import annotations

import warnings

import pytest

import ampnb
from ampnb import putback_state
from ampnb.device import tf32_switch
from ampnb.device.hardware import DeviceInfo

CPU = DeviceInfo("cpu", "cpu", "CPU", None)
AMPERE = DeviceInfo("cuda:0", "cuda", "NVIDIA A100", (8, 0))
TURING = DeviceInfo("cuda:0", "cuda", "Tesla T4", (7, 5))


@pytest.fixture
def present(monkeypatch):
    def use(*found: DeviceInfo) -> None:
        monkeypatch.setattr(tf32_switch, "devices", lambda: list(found))
    return use


def _said(action) -> list[str]:
    before = putback_state.torch_state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        action()
    assert putback_state.torch_state() == before
    assert [w.filename for w in caught] == [__file__] * len(caught)  # the user's line
    return [str(w.message) for w in caught]


def _with_block():
    with ampnb.tf32(True):
        pass


def _set_and_restore():
    tf32_switch.restore_tf32(ampnb.set_tf32(True))


def test_on_a_cpu_tf32_on_says_that_it_changes_nothing(present):
    present(CPU)
    (said,) = _said(_with_block)
    assert said.startswith("ampnb.tf32(True) (restored after the block): TF32 has no effect on cpu")
    assert "CUDA tensor-core mode" in said and "fp32 matmuls here stay full fp32" in said
    (said,) = _said(_set_and_restore)
    assert said.startswith("ampnb.set_tf32(True): TF32 has no effect on cpu")


def test_a_gpu_before_ampere_is_named(present):
    present(CPU, TURING)
    (said,) = _said(_with_block)
    assert "TF32 has no effect on cuda:0 (Tesla T4, compute capability 7.5 < 8.0)" in said


def test_where_tf32_is_real_or_it_is_switched_off_nothing_is_said(present):
    present(CPU, TURING, DeviceInfo("cuda:1", "cuda", "NVIDIA A100", (8, 0)))
    assert _said(_with_block) == []
    present(CPU, AMPERE)
    assert _said(_set_and_restore) == []
    present(CPU)

    def off():
        with ampnb.tf32(False):
            pass
    assert _said(off) == []


def test_the_warning_leaves_the_flags_as_the_switch_sets_and_restores_them(present):
    present(CPU)
    before = tf32_switch.tf32_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ampnb.tf32(True) as inside:
            assert inside.matmul
    assert tf32_switch.tf32_state() == before
