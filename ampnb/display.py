"""The one display module: Table, the mixin that renders results from table(), formatters."""

from __future__ import annotations

import html
import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Table:
    """Rows of already-formatted cells with a header; renders the same way every time."""

    headers: Sequence[str]
    rows: Sequence[Sequence[Any]]
    caption: str = ""
    notes: Sequence[str] = field(default_factory=tuple)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(str(h))}</th>" for h in self.headers)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>"
            for row in self.rows
        )
        cap = f"<caption>{html.escape(self.caption)}</caption>" if self.caption else ""
        notes = "".join(f"<p>{html.escape(n)}</p>" for n in self.notes)
        return (
            f'<table class="ampnb-table">{cap}<thead><tr>{head}</tr></thead>'
            f"<tbody>{body}</tbody></table>{notes}"
        )

    def __repr__(self) -> str:
        cells = [[str(h) for h in self.headers]] + [[str(c) for c in r] for r in self.rows]
        widths = [max(len(row[i]) for row in cells) for i in range(len(self.headers))]
        lines = [self.caption] if self.caption else []
        for k, row in enumerate(cells):
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
            if k == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines.extend(self.notes)
        return "\n".join(lines)

    __str__ = __repr__


class TableView:
    """Mixin: a result with a `table()` shows that table in Jupyter and as its repr."""

    def table(self) -> Table:
        raise NotImplementedError

    def _repr_html_(self) -> str:
        return self.table()._repr_html_()

    def __repr__(self) -> str:
        return repr(self.table())


def format_bytes(n: int | float | None) -> str:
    """1536 -> '1.5 KiB'; exact bytes below 1 KiB; None -> '-'."""
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def format_seconds(seconds: float | None) -> str:
    """0.0123 -> '12.3 ms'; 2.5 -> '2.5 s'; None -> '-'."""
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def format_percent(fraction: float) -> str:
    """0.0123 -> '1.23%'; exact 0 -> '0'; tiny but nonzero -> '<0.001%'."""
    if fraction == 0:
        return "0"
    return f"{100 * fraction:.3g}%" if fraction >= 1e-5 else "<0.001%"


def dtype_name(dtype: torch.dtype | None) -> str:
    """torch.bfloat16 -> 'bfloat16'; None -> '-'."""
    return "-" if dtype is None else str(dtype).removeprefix("torch.")


# Core results draw themselves through these names: the core never imports the display or
# Jupyter side (tests/test_import.py), the display layer resolves a name on first use.
VIEWS = {
    "doctor.layers": "ampnb.plots.doctor:plot_layers",
    "watch.plot": "ampnb.plots.watch:plot_records",
    "watch.panel": "ampnb.panels.watch_panel:WatchPanel",
}


def view(name: str) -> Any:
    """The display-layer function or class registered as `name` (ImportError without its library)."""
    if name not in VIEWS:
        raise ValueError(f"unknown view {name!r}; known: {', '.join(sorted(VIEWS))}")
    module, _, attr = VIEWS[name].partition(":")
    return getattr(importlib.import_module(module), attr)
