"""Watchers that attach to a model and detach cleanly: coverage, capture, tracer, hunter, memory."""

from __future__ import annotations

from ampnb._lazy import lazy_exports

# Public name -> module; resolved on first use so importing one instrument stays cheap.
_EXPORTS = {
    "Coverage": "ampnb.instruments.coverage_stats",
    "coverage": "ampnb.instruments.coverage_stats",
    "coverage_many": "ampnb.instruments.coverage_stats",
    "coverage_table": "ampnb.instruments.coverage_stats",
    "exponent_histogram": "ampnb.instruments.coverage_stats",
    "EXP_BINS": "ampnb.instruments.coverage_stats",
    "capture": "ampnb.instruments.tensor_capture",
    "Capture": "ampnb.instruments.tensor_capture",
    "TensorStats": "ampnb.instruments.summaries",
    "summarize": "ampnb.instruments.summaries",
    "trace_ops": "ampnb.instruments.trace",
    "OpTrace": "ampnb.instruments.trace",
    "OpRow": "ampnb.instruments.trace",
    "find_nonfinite": "ampnb.instruments.hunt",
    "NonFinite": "ampnb.instruments.hunt",
    "memory_report": "ampnb.instruments.memory",
    "measure_memory": "ampnb.instruments.memory",
    "MemoryStats": "ampnb.instruments.memory",
    "MemoryReport": "ampnb.instruments.memory",
    "memory_meter": "ampnb.instruments.memory",
    "MemoryMeter": "ampnb.instruments.memory",
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
