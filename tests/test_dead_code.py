"""Code nothing calls is removed (#43): each name here had no caller in ampnb, tests, notebooks,
benchmarks or docs."""

from __future__ import annotations

import importlib

import pytest

GONE = [("ampnb.lowbit.blockwise", "Blockwise"), ("ampnb.lowbit.blockwise", "blockwise"),
        ("ampnb.diagnosis.layers", "worst_local"), ("ampnb.diagnosis.store", "Store.tiers"),
        ("ampnb.start", "Start.model_copy"), ("ampnb.scaler.stepper", "ScalerStepper.current_stage")]


@pytest.mark.parametrize(("module", "name"), GONE)
def test_dead_code_is_gone(module, name):
    obj = importlib.import_module(module)
    *owner, attr = name.split(".")
    for part in owner:
        obj = getattr(obj, part)
    assert not hasattr(obj, attr), f"{module}.{name}"
