"""A small deterministic table: HTML for Jupyter, aligned text for nbval and terminals."""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


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
