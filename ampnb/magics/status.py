"""`%amp` alone: the session defaults, the devices, the support table and measured matmul speed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ampnb.display import Table


@dataclass(frozen=True)
class AmpStatus:
    """Several tables shown together."""

    tables: tuple[Table, ...]

    def _repr_html_(self) -> str:
        return "\n".join(t._repr_html_() for t in self.tables)

    def __repr__(self) -> str:
        return "\n\n".join(repr(t) for t in self.tables)


def status(defaults: dict[str, Any], measure: bool = False) -> AmpStatus:
    """Defaults of %%amp, support per device, and matmul throughput (measured once, cached)."""
    from ampnb.device import support_table, tf32_state, throughput_table

    now = "on" if tf32_state().matmul else "off"
    rows = [(k, str(v)) for k, v in defaults.items()]
    rows.append(("TF32 flags now", now))
    table = Table(("%%amp default", "value"), rows, caption="%%amp defaults (set with %amp MODE, "
                  "%amp --device D, %amp --tf32 X, or %config AmpMagics.default_mode = ...)")
    return AmpStatus((table, support_table(), throughput_table(refresh=measure)))
