"""The watch: `ampnb.watch(model, optimizer, scaler)` records a user's own training loop per
optimizer step, through hooks only; `Watch` is what it returns.

`ampnb.watch` is the plain function `ampnb.watcher.watch`; what a watch writes and what reads
it back (`read_log`, `StepRecord`, the tables) live in `ampnb.watchlog`.
"""

from __future__ import annotations

from ampnb.watcher.core import Watch, watch

__all__ = ["Watch", "watch"]
