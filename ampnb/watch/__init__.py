"""ampnb.watch: record a user's own training loop per optimizer step, through hooks only.

`ampnb.watch(model, optimizer, scaler)` calls `ampnb.watch.watch`: the package is callable, so
that `ampnb.watch` is one object however it was first reached (a lazy name, an import of a
submodule such as `ampnb.watch.records`).
"""

from __future__ import annotations

from ampnb._lazy import callable_package
from ampnb.watch.core import Watch, watch
from ampnb.watch.records import LayerStats, StepRecord, read_log

__all__ = ["LayerStats", "StepRecord", "Watch", "read_log", "watch"]

callable_package(__name__, watch)  # ampnb.watch(...) with watch's own signature and docstring
