"""Fixtures of the zoo: one fresh model per test (cheap: each builds in well under a second)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The shared test kits (tests/_*.py) are importable when the zoo runs on its own too.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

pytest.importorskip("transformers")

from zoo_models import BUILDERS, Case  # noqa: E402


@pytest.fixture(params=sorted(BUILDERS))
def case(request: pytest.FixtureRequest) -> Case:
    """Every zoo model in turn."""
    return BUILDERS[request.param]()
