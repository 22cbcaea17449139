"""How a mode shows itself: a table of what it does (attached to the shipped modes, not the base)."""

from __future__ import annotations

from ampnb.display import Table, TableView, dtype_name


class ModeView(TableView):
    """Mixin for a mode (listed after the base): `table()`, and Jupyter shows that table."""

    def table(self) -> Table:
        """What the mode does: autocast and parameter dtypes, scaler, hardware."""
        rows = [
            ("autocast dtype", dtype_name(self.autocast_dtype)),
            ("parameter dtype", dtype_name(self.param_dtype)),
            ("GradScaler", "yes" if self.uses_scaler else "no"),
            ("needs", self.requirements),
        ]
        return Table(("", self.name), rows, caption=self.description)
