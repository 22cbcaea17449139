"""ipywidgets panels: PrecisionPanel, RangeExplorer, ScalerPanel (imported on first use)."""

from __future__ import annotations

from ampnb._lazy import lazy_exports

_EXPORTS = {
    "PrecisionPanel": "ampnb.panels.precision_panel",
    "RangeExplorer": "ampnb.panels.range_explorer",
    "ScalerPanel": "ampnb.panels.scaler_panel",
    "WatchPanel": "ampnb.panels.watch_panel",
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
