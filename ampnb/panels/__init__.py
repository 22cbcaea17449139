"""ipywidgets panels: PrecisionPanel, RangeExplorer, ScalerPanel (imported on first use)."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "PrecisionPanel": "ampnb.panels.precision_panel",
    "RangeExplorer": "ampnb.panels.range_explorer",
    "ScalerPanel": "ampnb.panels.scaler_panel",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'ampnb.panels' has no attribute {name!r}")
