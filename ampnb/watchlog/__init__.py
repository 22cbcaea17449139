"""What a watch writes and what reads it back: the records, their JSON-lines log, their tables.

Data only, below the watch and below what draws it (`plots/watch.py`, `panels/watch_panel.py`),
so that those read a run without importing the watch that records it.
"""

from __future__ import annotations

from ampnb.watchlog.records import LayerStats, StepRecord, read_log

__all__ = ["LayerStats", "StepRecord", "read_log"]
