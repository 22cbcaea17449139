"""The watch's records and JSON-lines log, as `ampnb.watchlog.records` defines them."""

from ampnb.watchlog.records import (
    HEADROOM_FORMATS,
    KINDS,
    LOG_NAME,
    LayerStats,
    StepRecord,
    as_dict,
    log_path,
    read_log,
    write,
)

__all__ = ["HEADROOM_FORMATS", "KINDS", "LOG_NAME", "LayerStats", "StepRecord", "as_dict",
           "log_path", "read_log", "write"]
