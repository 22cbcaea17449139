"""ampnb: see and poke PyTorch mixed precision inside Jupyter."""

from __future__ import annotations

from typing import Any

from ampnb._lazy import lazy_exports

__version__ = "0.1.0"

# Public name -> module that defines it. Imported on first use so that `import ampnb`
# stays fast and never pulls in IPython, ipywidgets or matplotlib.
_EXPORTS: dict[str, str] = {
    "FloatFormat": "ampnb.formats",
    "FORMATS": "ampnb.formats",
    "get_format": "ampnb.block_formats",
    "quantize": "ampnb.block_formats",
    "BlockFormat": "ampnb.block_formats",
    "BLOCK_FORMATS": "ampnb.block_formats",
    "PrecisionMode": "ampnb.modes",
    "MODES": "ampnb.modes",
    "get_mode": "ampnb.modes",
    "Precision": "ampnb.precision",
    "explain_precision": "ampnb.legacy",
    "TransformerEnginePrecision": "ampnb.modes",
    "devices": "ampnb.device",
    "support": "ampnb.device",
    "support_table": "ampnb.device",
    "tf32": "ampnb.device",
    "set_tf32": "ampnb.device",
    "coverage": "ampnb.instruments",
    "capture": "ampnb.instruments",
    "trace_ops": "ampnb.instruments",
    "find_nonfinite": "ampnb.instruments",
    "memory_report": "ampnb.instruments",
    "Workbench": "ampnb.workbench",
    "ScalerStepper": "ampnb.scaler",
    "compare": "ampnb.comparison",
    "doctor": "ampnb.diagnosis",
    "keep_fp32": "ampnb.selective",
    "set_fp16_kernels": "ampnb.fp16_kernels",
    "emulated_fp16_kernels": "ampnb.fp16_kernels",
    "run_distributed": "ampnb.distributed",
    "what_if": "ampnb.whatif",
    "watch": "ampnb.watcher",
    "WhatIf": "ampnb.whatif",
}
_SUBMODULES = {"formats", "modes", "device", "models", "instruments", "plots", "panels", "fp8",
               "lowbit", "distributed", "watcher", "watchlog", "diagnosis",
               "integrations"}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS, _SUBMODULES)


def load_ipython_extension(ipython: Any) -> None:
    """Register %%amp and %amp (called by `%load_ext ampnb`)."""
    from ampnb.magics import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """Remove every magic and hook that `%load_ext ampnb` added."""
    from ampnb.magics import unload_ipython_extension as unload

    unload(ipython)
