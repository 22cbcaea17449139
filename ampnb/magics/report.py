"""What one `%%amp` cell did: the object `-o NAME` keeps, shown as a table."""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any

from ampnb.comparison import Comparison
from ampnb.display import Table, format_seconds
from ampnb.magics.cell import Made

SHOWN = 12  # rows of the table; .made keeps them all


@dataclass(frozen=True, eq=False)
class AmpRun:
    """Mode, device, TF32, wall time and the dtypes of what the cell made; extras when asked."""

    mode: str
    device: str
    tf32: str
    seconds: float | None
    made: tuple[Made, ...] = ()
    notes: tuple[str, ...] = ()
    value: Any = field(default=None, repr=False)
    comparison: Comparison | None = None
    code: str | None = None
    extras: tuple[Any, ...] = ()  # instrument reports (op trace, non-finite hunt, memory)
    why: str = ""  # why the device was chosen, e.g. "where the parameters of lin are"

    @property
    def caption(self) -> str:
        took = "" if self.seconds is None else f" · {format_seconds(self.seconds)}"
        why = f" ({self.why})" if self.why else ""
        return f"%%amp {self.mode} on {self.device}{why} · TF32 {self.tf32}{took}"

    def table(self) -> Table:
        """What the cell made, with mode, device and TF32 in the caption."""
        rows = [(m.name, m.kind, m.dtype, m.shape) for m in self.made[:SHOWN]]
        notes = self.notes if rows else ("the cell made no tensors or modules", *self.notes)
        if len(self.made) > SHOWN:
            notes = (f"... and {len(self.made) - SHOWN} more (all of them in .made)", *notes)
        return Table(("name", "type", "dtype", "shape"), rows, caption=self.caption, notes=notes)

    def _parts(self) -> list[Any]:
        first = self.comparison if self.comparison is not None else self.table()
        return [first, *self.extras]

    def _repr_html_(self) -> str:
        out = []
        for part in self._parts():
            out.append(part._repr_html_() if hasattr(part, "_repr_html_")
                       else f"<pre>{html.escape(repr(part))}</pre>")
        if self.comparison is not None and self.notes:
            out.extend(f"<p>{html.escape(n)}</p>" for n in self.notes)
        if self.code:
            out.append(f"<pre>{html.escape(self.code)}</pre>")
        return "\n".join(out)

    def __repr__(self) -> str:
        parts = [repr(p) for p in self._parts()]
        if self.comparison is not None and self.notes:
            parts.append("\n".join(self.notes))
        if self.code:
            parts.append(self.code)
        return "\n\n".join(parts)
