"""The watch's records as tables, as `ampnb.watchlog.table` defines them."""

from ampnb.watchlog.table import (
    LayersTable,
    StepsTable,
    StepSummary,
    layers_table,
    loss_text,
    records_table,
    summarize,
)

__all__ = ["LayersTable", "StepSummary", "StepsTable", "layers_table", "loss_text",
           "records_table", "summarize"]
