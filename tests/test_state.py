"""putback_state.torch_state() sees every global flag ampnb may touch: each change below makes it differ."""

from __future__ import annotations

import contextlib

import pytest
import torch

from ampnb.putback_state import torch_state as snapshot


def _module_hook():
    handle = torch.nn.modules.module.register_module_buffer_registration_hook(lambda *a: None)
    try:
        yield
    finally:
        handle.remove()


CHANGES = {
    "saved tensors hooks": lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
    "inference mode": torch.inference_mode,
    "autocast cache": lambda: _flag(torch.set_autocast_cache_enabled, torch.is_autocast_cache_enabled()),
    "anomaly check nan": lambda: torch.autograd.set_detect_anomaly(True, check_nan=False),
    "deterministic": lambda: _flag(torch.use_deterministic_algorithms,
                                   torch.are_deterministic_algorithms_enabled()),
    "default device": lambda: torch.device("meta"),
    "torch function mode": lambda: torch.overrides.TorchFunctionMode(),
    "module buffer hook": lambda: contextlib.contextmanager(_module_hook)(),
    "mkldnn fp32 precision": lambda: _flag(lambda v: setattr(torch.backends.mkldnn.matmul,
                                                             "fp32_precision", v),
                                           torch.backends.mkldnn.matmul.fp32_precision, "bf16"),
    "autocast on mps": lambda: torch.autocast("mps", dtype=torch.bfloat16),
}


@contextlib.contextmanager
def _flag(setter, now, other=None):
    setter(not now if other is None else other)
    try:
        yield
    finally:
        setter(now)


@pytest.mark.parametrize("name", list(CHANGES))
def test_snapshot_sees_the_change_and_its_undoing(name):
    before = snapshot()
    try:
        context = CHANGES[name]()
    except (RuntimeError, AttributeError) as e:  # absent in this torch build
        pytest.skip(f"{name}: {e}")
    with context:
        assert snapshot() != before, name
    assert snapshot() == before
