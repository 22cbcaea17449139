"""One TF32 setting type: the same spellings and the same refusals in the core, compare, %%amp, Workbench."""

from __future__ import annotations

import re

import pytest
import torch
from _workbench_kit import make

from ampnb import putback_state
from ampnb.comparison import compare
from ampnb.device import TF32_ALLOWED, TF32Setting, tf32_context, tf32_setting, tf32_state
from ampnb.formats import quantize
from ampnb.workbench import Workbench

GOOD = [(True, TF32Setting.on), (False, TF32Setting.off), ("on", TF32Setting.on),
        ("off", TF32Setting.off), ("emulate", TF32Setting.emulate), (TF32Setting.on, TF32Setting.on),
        (None, None)]
BAD = ["yes", "ON", "", 1, 0, 1.0, "true", [True]]


@pytest.mark.parametrize(("spelling", "meant"), GOOD)
def test_every_spelling_means_one_setting(spelling, meant):
    assert tf32_setting(spelling) is meant


@pytest.mark.parametrize("bad", BAD)
def test_a_bad_setting_is_one_line_naming_the_allowed_values(bad):
    with pytest.raises(ValueError) as err:
        tf32_setting(bad)
    assert str(err.value) == f"unknown TF32 setting {bad!r}; allowed: {TF32_ALLOWED}"
    for value in ("True", "False", "'on'", "'off'", "'emulate'", "None"):
        assert value in TF32_ALLOWED


def test_the_setting_is_a_string_enum():
    assert [s.value for s in TF32Setting] == ["on", "off", "emulate"]
    assert TF32Setting.emulate == "emulate" and f"{TF32Setting.on}" == "on"


@pytest.mark.parametrize(("spelling", "meant"), GOOD)
def test_tf32_context_takes_the_same_spellings(spelling, meant):
    before = putback_state.torch_state()
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    with tf32_context(spelling) as emulation:
        y = a @ b
        if meant is not None:
            assert tf32_state().matmul is (meant is TF32Setting.on)
    assert putback_state.torch_state() == before
    if meant is TF32Setting.emulate:
        assert emulation.rounded_ops == 1
        assert torch.equal(y, quantize(a, "tf32") @ quantize(b, "tf32"))
    else:
        assert emulation is None and torch.equal(y, a @ b)


@pytest.mark.parametrize("bad", BAD)
def test_tf32_context_refuses_before_changing_anything(bad):
    before = putback_state.torch_state()
    with pytest.raises(ValueError, match="unknown TF32 setting"):
        tf32_context(bad)
    assert putback_state.torch_state() == before


@pytest.mark.parametrize(("spelling", "meant"), GOOD)
def test_compare_takes_the_same_spellings(spelling, meant):
    c = compare(lambda: torch.ones(2, 2) @ torch.ones(2, 2), ["32-true"], tf32=spelling, repeat=1)
    assert c is not None


@pytest.mark.parametrize("bad", BAD)
def test_compare_refuses_the_same_values(bad):
    with pytest.raises(ValueError, match=re.escape(f"tf32 must be one of {TF32_ALLOWED}, got {bad!r}")):
        compare(lambda: None, ["32-true"], tf32=bad, repeat=1)


def test_the_magics_take_the_same_spellings_and_blank_as_is():
    pytest.importorskip("IPython")
    from ampnb.magics.runs import tf32_setting as magic_setting

    assert magic_setting("") is None
    for spelling, meant in GOOD:
        assert magic_setting(spelling) is meant
    with pytest.raises(ValueError, match=re.escape(f"allowed: {TF32_ALLOWED}")):
        magic_setting("maybe")


@pytest.mark.parametrize(("spelling", "flag"), [(True, True), ("on", True), ("off", False),
                                                (False, False), (TF32Setting.on, True)])
def test_the_workbench_takes_bools_and_on_off(spelling, flag):
    wb = Workbench(*make(), tf32=spelling)
    assert wb.tf32 is flag
    wb.set(tf32="off" if flag else "on")
    assert wb.tf32 is (not flag)
    wb.set(tf32=None)
    assert wb.tf32 is (not flag)


@pytest.mark.parametrize("bad", ["emulate", *BAD])
def test_the_workbench_refuses_emulate_and_bad_values_and_changes_nothing(bad):
    wb = Workbench(*make(), tf32="on")
    with pytest.raises(ValueError, match="allowed: True, False, 'on', 'off' or None") as err:
        wb.set(tf32=bad)
    assert "\n" not in str(err.value) and wb.tf32 is True


def test_tf32_emulation_rounds_convolution_factors_forward_and_backward():
    """Conv and its backward see TF32-rounded factors; no Python dispatch mode is pushed."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 3, 9, 9, generator=g), torch.randn(4, 3, 3, 3, generator=g)
    gy = torch.randn(2, 4, 7, 7, generator=g)
    xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
    with tf32_context("emulate") as emulation:
        assert not _get_current_dispatch_mode_stack()
        y = torch.nn.functional.conv2d(xe, we)
        y.backward(gy)
    xr, wr = quantize(x, "tf32").requires_grad_(), quantize(w, "tf32").requires_grad_()
    ref = torch.nn.functional.conv2d(xr, wr)
    assert torch.equal(y, ref) and not torch.equal(y, torch.nn.functional.conv2d(x, w))
    gx, gw = torch.ops.aten.convolution_backward.default(
        quantize(gy, "tf32"), xr.detach(), wr.detach(), None, [1, 1], [0, 0], [1, 1], False,
        [0, 0], 1, [True, True, False])[:2]
    assert torch.equal(xe.grad, gx) and torch.equal(we.grad, gw)
    assert emulation.rounded_ops == 2
