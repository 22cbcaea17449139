"""ampnb._kernels: the pairs a block adds share one registration, and every kernel comes back."""

from __future__ import annotations

import pytest
import torch

from ampnb import putback_state
from ampnb._kernels import current_kernel, live_overrides
from ampnb.device.tf32_switch import TF32Emulation
from ampnb.fp16_kernels import EMULATED, Fp16KernelEmulation


def test_current_kernel_is_what_torch_library_get_kernel_gives():
    for op in EMULATED:
        assert repr(current_kernel(op, "CPU")) == repr(torch.library.get_kernel(op, "CPU"))
    assert repr(current_kernel("aten::mm", "CPU")) == repr(torch.library.get_kernel("aten::mm", "CPU"))


def _still_runs(override: object) -> None:
    """The override left entered still changes its products."""
    a = torch.randn(4, 4)
    if isinstance(override, Fp16KernelEmulation):
        seen = override.emulated_ops
        assert torch.equal(torch.mm(a.half(), a.half()), torch.mm(a.half().float(), a.half().float()).half())
        assert override.emulated_ops == seen + 1
    else:
        seen = override.rounded_ops
        torch.mm(a, a)
        assert override.rounded_ops == seen + 1


@pytest.mark.parametrize("first", ["fp16", "tf32"])
@pytest.mark.parametrize("leave", ["in order", "out of order"])
def test_overlapping_overrides_each_keep_working_and_hand_back_every_kernel(first, leave):
    before = putback_state.torch_state()
    made = {"fp16": Fp16KernelEmulation(), "tf32": TF32Emulation()}
    outer = made.pop(first)
    inner = made.popitem()[1]
    outer.__enter__()
    try:
        inner.__enter__()
        try:
            assert putback_state.torch_state().product_kernels != before.product_kernels
            gone, kept = (inner, outer) if leave == "in order" else (outer, inner)
            gone.__exit__(None, None, None)
            _still_runs(kept)
        finally:
            inner.__exit__(None, None, None)
    finally:
        outer.__exit__(None, None, None)
    assert live_overrides() == 0
    assert putback_state.torch_state() == before
