"""The watch's records as TensorBoard scalars and histograms (the optional `tensorboard` extra)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from ampnb.watchlog.records import HEADROOM_FORMATS, KINDS, StepRecord, log_path


def scalars(record: StepRecord) -> dict[str, float]:
    """The step's scalars by TensorBoard tag; what the record does not have is left out."""
    out = {"watch/skipped": float(record.skipped), "watch/nonfinite": float(record.nonfinite)}
    if not math.isnan(record.loss) or record.nonfinite:  # nan on a bad step is its loss
        out["watch/loss"] = record.loss
    if record.scale is not None:
        out["watch/scale"] = record.scale
    if record.lost_updates is not None:
        out["watch/lost_updates"] = record.lost_updates
    return out


def layer_scalars(record: StepRecord,
                  formats: tuple[str, ...] = HEADROOM_FORMATS) -> dict[str, float]:
    """Per layer: headroom of each kind to each format, and the fp16 flush share (measured only)."""
    out = {}
    for la in record.layers:
        for kind in KINDS:
            if la.amax(kind) > 0:  # nan (not measured) and 0 (no headroom to speak of) left out
                for fmt in formats:
                    out[f"headroom_{fmt}/{kind}/{la.module}"] = la.headroom(kind, fmt)
        if not math.isnan(la.fp16_flush):
            out[f"fp16_flush/{la.module}"] = la.fp16_flush
    return out


def log2_amax(record: StepRecord, kind: str) -> torch.Tensor:
    """log2 of each layer's `kind` amax at this step (the exponents the layers reach)."""
    vals = [la.amax(kind) for la in record.layers]
    t = torch.tensor([v for v in vals if v > 0 and math.isfinite(v)], dtype=torch.float64)
    return torch.log2(t)


class TensorBoardWriter:
    """Writes each StepRecord to TensorBoard under log_dir (log_dir/rank{r} for a rank)."""

    def __init__(self, log_dir: str | Path, rank: int | None = None,
                 formats: tuple[str, ...] = HEADROOM_FORMATS) -> None:
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
            raise ValueError(f"rank={rank!r} is not allowed; allowed: None or an integer >= 0")
        bad = [f for f in formats if f not in HEADROOM_FORMATS]
        if bad:
            raise ValueError(f"formats={bad!r} is not allowed; allowed: {HEADROOM_FORMATS}")
        try:
            from torch.utils.tensorboard import SummaryWriter  # optional: only when used
        except ImportError as err:
            raise ImportError("TensorBoardWriter needs the tensorboard package: "
                              "pip install tensorboard") from err
        self.log_dir = log_path(log_dir, rank).parent
        self.formats = tuple(formats)
        self._writer: Any = SummaryWriter(log_dir=str(self.log_dir))

    def write(self, record: StepRecord) -> None:
        """Scalars every step; headroom, flush share and log2-amax histograms on stats steps."""
        if not isinstance(record, StepRecord):
            raise ValueError(f"record={type(record).__name__} is not allowed; allowed: an "
                             "ampnb.watch StepRecord")
        if self._writer is None:
            raise ValueError("this TensorBoardWriter is closed; allowed: write before close()")
        w, step = self._writer, record.step
        wall = record.time if math.isfinite(record.time) else None
        for tag, v in {**scalars(record), **layer_scalars(record, self.formats)}.items():
            w.add_scalar(tag, v, step, walltime=wall)
        for kind in KINDS if record.layers else ():
            exps = log2_amax(record, kind)
            if exps.numel():
                # Bins one binade wide: the histogram reads as exponents reached by the layers.
                lo, hi = math.floor(exps.min().item()), math.floor(exps.max().item()) + 1
                edges = torch.arange(lo, hi + 1, dtype=torch.float64).numpy()
                w.add_histogram(f"log2_amax/{kind}", exps.numpy(), step, bins=edges,
                                walltime=wall)

    def flush(self) -> None:
        """Write what is queued to the event file now."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file (again: a no-op)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> TensorBoardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
