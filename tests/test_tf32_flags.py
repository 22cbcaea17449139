"""The TF32 switch: every legacy and new torch flag is set in step and restored exactly."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from ampnb import putback_state
from ampnb.device import TF32State, restore_tf32, set_tf32, tf32, tf32_state

NEW_API = hasattr(torch.backends.cuda.matmul, "fp32_precision") or hasattr(
    torch._C, "_get_fp32_precision_getter")
new_api_only = pytest.mark.skipif(not NEW_API, reason="this torch has no fp32_precision API")


def _read(getter):
    try:
        return getter()
    except RuntimeError:  # torch refuses to answer once legacy and new APIs disagree
        return "raises"


def torch_view() -> dict[str, object]:
    """Everything TF32-related that torch's public API shows (the reference, not ampnb)."""
    b = torch.backends
    view = {
        "matmul precision": _read(torch.get_float32_matmul_precision),
        "cuda.matmul.allow_tf32": _read(lambda: b.cuda.matmul.allow_tf32),
        "cudnn.allow_tf32": _read(lambda: b.cudnn.allow_tf32),
    }
    if NEW_API:
        for name, obj in [("generic", b), ("cuda.matmul", b.cuda.matmul), ("cudnn", b.cudnn),
                          ("cudnn.conv", b.cudnn.conv), ("cudnn.rnn", b.cudnn.rnn),
                          ("mkldnn", b.mkldnn), ("mkldnn.matmul", b.mkldnn.matmul),
                          ("mkldnn.conv", b.mkldnn.conv), ("mkldnn.rnn", b.mkldnn.rnn)]:
            view[name] = _read(lambda obj=obj: obj.fp32_precision)
    return view


def _set_new(path: str, value: str) -> None:
    *parents, _ = path.split(".")
    obj = torch.backends
    for p in parents:
        obj = getattr(obj, p)
    obj.fp32_precision = value


# How a user (or a library) may have left the flags before calling ampnb, with torch's own API.
START = {
    "defaults": lambda: None,
    "precision high": lambda: torch.set_float32_matmul_precision("high"),
    "precision medium": lambda: torch.set_float32_matmul_precision("medium"),
    "legacy cuda matmul on": lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", True),
    "legacy cudnn off": lambda: setattr(torch.backends.cudnn, "allow_tf32", False),
    "new cuda matmul tf32": lambda: _set_new("cuda.matmul.x", "tf32"),
    "new generic ieee": lambda: _set_new("x", "ieee"),
    "new cudnn conv ieee": lambda: _set_new("cudnn.conv.x", "ieee"),
    "new mkldnn matmul bf16": lambda: _set_new("mkldnn.matmul.x", "bf16"),
}
NEEDS_NEW_API = {k for k in START if k.startswith("new ")}


@pytest.fixture
def pristine():
    """Torch's warnings are errors; the process-wide flags are put back after each test."""
    saved = tf32_state()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # ampnb's own "TF32 has no effect on cpu" (tests/test_tf32_no_effect.py) is expected here.
        warnings.filterwarnings("ignore", r"ampnb\.(set_)?tf32\(True\).*TF32 has no effect",
                                UserWarning)
        yield
    restore_tf32(saved)
    assert tf32_state() == saved


@pytest.fixture(params=list(START))
def start(request, pristine):
    if request.param in NEEDS_NEW_API and not NEW_API:
        pytest.skip("this torch has no fp32_precision API")
    START[request.param]()
    return request.param


@pytest.mark.parametrize("enabled", [True, False])
def test_switch_restores_every_flag_after_an_exception(start, enabled):
    before, view = tf32_state(), torch_view()
    with pytest.raises(KeyError), tf32(enabled):
        raise KeyError("user code failed")
    assert tf32_state() == before
    assert torch_view() == view


@pytest.mark.parametrize("enabled", [True, False])
def test_inside_the_switch_torch_agrees_with_itself(start, enabled):
    with tf32(enabled) as now:
        # torch's own consistency checks pass: no "mix of the legacy and new APIs" error
        assert torch.backends.cuda.matmul.allow_tf32 is enabled
        assert torch.backends.cudnn.allow_tf32 is enabled
        assert now == tf32_state() and now.matmul is enabled
        if NEW_API:
            want = "tf32" if enabled else "ieee"
            assert torch.backends.cuda.matmul.fp32_precision == want
            assert torch.backends.cudnn.conv.fp32_precision == want
            assert torch.backends.cudnn.rnn.fp32_precision == want


def test_snapshot_is_equal_after_a_raising_body(pristine):
    before = putback_state.torch_state()
    for enabled in (True, False):
        with pytest.raises(ZeroDivisionError), tf32(enabled):
            assert putback_state.torch_state() != before or enabled is False
            _ = 1 / 0
        assert putback_state.torch_state() == before


def test_switching_on_leaves_cpu_settings_alone(pristine):
    before = torch.backends.mkldnn.matmul.fp32_precision if NEW_API else None
    with tf32(True):
        assert (torch.backends.mkldnn.matmul.fp32_precision if NEW_API else None) == before


def test_set_tf32_returns_the_previous_state_and_restore_undoes_it(pristine):
    start = tf32_state()
    view = torch_view()
    previous = set_tf32(True)
    assert previous == start
    assert torch.get_float32_matmul_precision() == "high"
    again = set_tf32(False)
    assert again.matmul and not tf32_state().matmul
    assert torch.get_float32_matmul_precision() == "highest"
    restore_tf32(previous)
    assert tf32_state() == start and torch_view() == view


def test_state_is_frozen_and_reads_change_nothing(pristine):
    view = torch_view()
    state = tf32_state()
    assert isinstance(state, TF32State)
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.matmul_precision = "high"
    assert torch_view() == view


@new_api_only
def test_mixed_api_state_is_read_without_changing_it(pristine):
    _set_new("cuda.matmul.x", "tf32")  # new API only: the legacy getters now refuse
    view = torch_view()
    assert view["cuda.matmul.allow_tf32"] == "raises"
    state = tf32_state()
    assert state.matmul_precision == "highest" and state.matmul
    assert torch_view() == view


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_set_tf32_refuses_non_bool_and_changes_nothing(pristine, bad):
    before = tf32_state()
    with pytest.raises(ValueError, match=f"set_tf32 takes True or False, got {bad!r}"):
        set_tf32(bad)
    with pytest.raises(ValueError), tf32(bad):
        pass
    assert tf32_state() == before


def test_restore_refuses_a_wrong_object(pristine):
    with pytest.raises(ValueError, match="restore_tf32 needs a TF32State"):
        restore_tf32({"matmul_precision": "high"})
