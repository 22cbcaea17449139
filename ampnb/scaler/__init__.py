"""GradScaler + gradient accumulation, one stage at a time (pure core: torch only)."""

from ampnb.scaler.guidance import GUIDANCE, Guidance, diagnose, explain, explain_error
from ampnb.scaler.records import GradStats, StageRecord, StepRecord, history_table
from ampnb.scaler.settings import ScalerSettings
from ampnb.scaler.stages import STAGES, Stage
from ampnb.scaler.stepper import ScalerStepper

__all__ = ["GUIDANCE", "STAGES", "GradStats", "Guidance", "ScalerSettings", "ScalerStepper",
           "Stage", "StageRecord", "StepRecord", "diagnose", "explain", "explain_error",
           "history_table"]
