"""An interrupt inside FP8 set-up, restore or a model swap leaves torch and the model as before."""

from __future__ import annotations

import signal
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import ampnb.fp8.autocast as fp8_autocast_module
from ampnb.fp8 import Fp8Linear, convert_to_fp8, fp8_autocast, revert_fp8
from ampnb.fp8.autocast import emulated_fp8_context, fp8_active
from ampnb.lowbit import quantize_model
from ampnb.putback_state import torch_state as snapshot


def interrupt_after(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str,
                    when: Callable[..., bool] = lambda *a, **k: True) -> None:
    """Make owner.name send SIGINT to this process right after it has done its work.

    A real signal, so it is held where ampnb defers interrupts and raised at once elsewhere.
    """
    real = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        if when(*args, **kwargs):
            signal.raise_signal(signal.SIGINT)
        return out

    monkeypatch.setattr(owner, name, wrapper)


@pytest.mark.parametrize(("owner", "name"), [(torch, "set_default_dtype"),
                                             (torch.autocast, "__enter__")])
def test_emulated_fp8_context_set_up_interrupted_restores_everything(monkeypatch, owner, name):
    before = snapshot()
    interrupt_after(monkeypatch, owner, name)
    with pytest.raises(KeyboardInterrupt), emulated_fp8_context("cpu", torch.bfloat16):
        pytest.fail("the body must not run")  # pragma: no cover
    monkeypatch.undo()
    assert snapshot() == before and not fp8_active()


def test_emulated_fp8_context_restore_interrupted_still_completes(monkeypatch):
    before = snapshot()
    with pytest.raises(KeyboardInterrupt), emulated_fp8_context("cpu", torch.bfloat16):
        assert fp8_active() and torch.get_default_dtype() == torch.bfloat16
        interrupt_after(monkeypatch, torch, "set_default_dtype")
    monkeypatch.undo()
    assert snapshot() == before and not fp8_active()


class _LoudVar:
    """A ContextVar stand-in whose set() is followed by an interrupt."""

    def __init__(self) -> None:
        self.real = fp8_autocast_module._ACTIVE

    def get(self) -> bool:
        return self.real.get()

    def set(self, value: bool) -> Any:
        token = self.real.set(value)
        signal.raise_signal(signal.SIGINT)
        return token

    def reset(self, token: Any) -> None:
        self.real.reset(token)


def test_fp8_autocast_set_up_interrupted_leaves_it_off(monkeypatch):
    monkeypatch.setattr(fp8_autocast_module, "_ACTIVE", _LoudVar())
    with pytest.raises(KeyboardInterrupt), fp8_autocast(True):
        pytest.fail("the body must not run")  # pragma: no cover
    assert not fp8_active()


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.Linear(16, 32))


def test_convert_in_place_interrupted_after_one_swap_leaves_the_model_as_it_was(monkeypatch):
    model = mlp()
    layers, params = list(model), list(model.parameters())
    interrupt_after(monkeypatch, nn.Module, "__setattr__",
                    lambda self, name, value: isinstance(value, Fp8Linear))
    with pytest.raises(KeyboardInterrupt):
        convert_to_fp8(model, inplace=True)
    monkeypatch.undo()
    assert list(model) == layers and all(a is b for a, b in zip(model.parameters(), params))


def test_revert_interrupted_after_one_swap_leaves_the_model_in_fp8(monkeypatch):
    model, _ = convert_to_fp8(mlp())
    layers = list(model)
    interrupt_after(monkeypatch, nn.Module, "__setattr__",
                    lambda self, name, value: isinstance(value, nn.Linear))
    with pytest.raises(KeyboardInterrupt):
        revert_fp8(model)
    monkeypatch.undo()
    assert list(model) == layers and sum(isinstance(m, Fp8Linear) for m in model) == 3


def test_transformer_engine_mode_conversion_interrupted_leaves_the_model(monkeypatch):
    from ampnb import get_mode

    model = mlp()
    layers = list(model)
    interrupt_after(monkeypatch, nn.Module, "__setattr__",
                    lambda self, name, value: isinstance(value, Fp8Linear))
    with pytest.raises(KeyboardInterrupt), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        get_mode("transformer-engine").convert_module(model)
    monkeypatch.undo()
    assert list(model) == layers and model[0].weight.dtype == torch.float32


def test_quantize_model_interrupted_while_hooking_leaves_no_hook(monkeypatch):
    model = mlp()
    before = snapshot()
    interrupt_after(monkeypatch, nn.Module, "register_forward_hook")
    with pytest.raises(KeyboardInterrupt):
        quantize_model(model, "nf4", inputs=torch.randn(2, 16))
    monkeypatch.undo()
    assert not any(m._forward_hooks for m in model.modules()) and snapshot() == before


def test_fp8_stats_interrupted_while_attaching_leaves_no_observer(monkeypatch):
    from ampnb.fp8 import Fp8Stats

    model, _ = convert_to_fp8(mlp())
    interrupt_after(monkeypatch, nn.Module, "__setattr__",
                    lambda self, name, value: name == "observer" and value is not None)
    with pytest.raises(KeyboardInterrupt):
        Fp8Stats(model)
    monkeypatch.undo()
    assert all(m.observer is None for m in model if isinstance(m, Fp8Linear))
