"""Which ops ran in which dtype during one probe step (via ampnb.instruments.trace_ops)."""

from __future__ import annotations

from typing import Any

from ampnb._html import Table


def op_summary(workbench: Any) -> Table | None:
    """The op/dtype table of one forward+backward in the current mode; None without a tracer."""
    try:
        from ampnb.instruments import trace_ops
    except ImportError:  # the tracer is optional: the panel leaves its table out
        return None
    trace = workbench.probe(trace_ops)
    summary = getattr(trace, "summary", None)
    return summary() if callable(summary) else None
