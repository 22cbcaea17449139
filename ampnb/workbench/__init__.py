"""Workbench: train a real model step by step while switching precision mode, device and TF32."""

from ampnb.workbench.core import PrecisionLossWarning, Workbench
from ampnb.workbench.records import StepRecord, history_table, speedup

__all__ = ["PrecisionLossWarning", "StepRecord", "Workbench", "history_table", "speedup"]
