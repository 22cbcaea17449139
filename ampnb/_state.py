"""A snapshot of the global torch state that ampnb promises to leave as it found it.

Read in `ampnb.putback` (the one home for putting things back); kept importable here as
`_state.snapshot()`, the before/after check of the magics and the tests.
"""

from __future__ import annotations

from ampnb.putback_state import TorchState
from ampnb.putback_state import torch_state as snapshot

__all__ = ["TorchState", "snapshot"]
