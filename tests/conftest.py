"""Shared test settings."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True, scope="session")
def _doctor_budget_floor() -> Iterator[None]:
    """A budget in steps is at least a minute in tests (session-wide, so module fixtures see it
    too): on a toy model a step is a millisecond, and a loaded CI machine must not cut the work a
    test checks. The budget's own tests read the floor from the module, so they test whatever
    it is."""
    from ampnb.diagnosis import budget

    floor = budget.MIN_SECONDS
    budget.MIN_SECONDS = 60.0
    yield
    budget.MIN_SECONDS = floor


@pytest.fixture
def gpu_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """This CPU machine as a GPU machine looks to ampnb: CUDA available, a cuda:0 listed (the
    tensors stay on the CPU: the code that chooses the device sees a GPU machine)."""
    import torch

    from ampnb.device import hardware

    cpu = hardware._devices()[0]
    fake = hardware.DeviceInfo("cuda:0", "cuda", "simulated GPU", (9, 0))
    monkeypatch.setattr(hardware, "_devices", lambda: (cpu, fake))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
