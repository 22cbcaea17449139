"""ampnb.watch: record a user's own training loop per optimizer step, through hooks only."""

from __future__ import annotations

from ampnb.watch.records import LayerStats, StepRecord, read_log

__all__ = ["LayerStats", "StepRecord", "read_log"]
