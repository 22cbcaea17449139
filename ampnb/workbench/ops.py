"""Which ops ran in which dtype during one probe step (via ampnb.instruments.trace_ops)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from ampnb.display import Table
from ampnb.instruments.trace import trace_ops

# trace category -> what the row says to a learner, in the order the rows are shown.
CATEGORY_LABELS = {
    "lowered": "ran in lower precision",
    "kept": "kept fp32/fp64",
    "promoted": "promoted to a wider float",
    "cast": "dtype casts (_to_copy)",
    "other": "views and non-float ops",
}
_SHOWN_OPS = 6  # op names listed per row; the count covers all of them


def summary_table(trace: Any, mode: str = "") -> Table:
    """Counts per category of a finished OpTrace, with output dtypes and the commonest ops."""
    ops: dict[str, Counter[str]] = {c: Counter() for c in CATEGORY_LABELS}
    dtypes: dict[str, set[str]] = {c: set() for c in CATEGORY_LABELS}
    for row, n in trace.grouped.items():
        ops[row.category][row.op] += n
        if row.output_dtype:
            dtypes[row.category].add(row.output_dtype)
    rows = []
    for cat, label in CATEGORY_LABELS.items():
        if not ops[cat]:
            continue
        names = [op for op, _ in ops[cat].most_common(_SHOWN_OPS)]
        more = len(ops[cat]) - len(names)
        rows.append((label, sum(ops[cat].values()), ", ".join(sorted(dtypes[cat])) or "-",
                     ", ".join(names) + (f" (+{more} more)" if more else "")))
    caption = "ops of one forward + backward" + (f" under {mode}" if mode else "")
    return Table(("ops", "count", "output dtypes", "commonest"), rows, caption=caption,
                 notes=(trace.summary(),))


def op_summary(workbench: Any) -> Table:
    """The op/dtype summary of one forward+backward in the current mode."""
    return summary_table(workbench.probe(trace_ops), workbench.mode.name)
