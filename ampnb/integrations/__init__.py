"""ampnb.watch where users train: a Lightning Callback and a Hugging Face TrainerCallback.

Each lives in its own module, which imports its framework when first touched; importing this
package imports neither: `from ampnb.integrations.lightning import PrecisionMonitor`,
`from ampnb.integrations.transformers import PrecisionMonitorCallback`.
"""

from __future__ import annotations

from ampnb._lazy import lazy_exports
from ampnb.watcher.tensorboard import scalars as _scalars
from ampnb.watchlog.records import StepRecord

PREFIX = "ampnb/"  # the metric names the Trainers' loggers get: ampnb/scale, ampnb/skipped, ...


def metrics(record: StepRecord) -> dict[str, float]:
    """The step's scalars as the Trainers' loggers get them (what the record lacks left out)."""
    return {PREFIX + tag.split("/", 1)[1]: value for tag, value in _scalars(record).items()}


# ampnb.integrations.lightning / .transformers and the two classes, imported when first touched
__getattr__ = lazy_exports(__name__, {"PrecisionMonitor": "ampnb.integrations.lightning",
                                      "PrecisionMonitorCallback": "ampnb.integrations.transformers"},
                           {"lightning", "transformers"})[0]
