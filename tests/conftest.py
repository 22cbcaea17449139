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
