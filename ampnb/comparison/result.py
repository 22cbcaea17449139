"""What compare measured: one Row per mode, the Comparison table, and errors between results."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ampnb._tree import named_leaves
from ampnb.display import Table, TableView, format_bytes, format_seconds
from ampnb.modes import get_mode

REFERENCE = "32-true"


@dataclass(frozen=True)
class Row:
    """One mode's measurements; errors are against the 32-true run of the same work."""

    label: str
    mode: str
    tf32: str | None
    seconds: float
    times: tuple[float, ...]
    speedup: float
    saved_bytes: int
    peak_bytes: int | None
    max_abs_error: float
    rel_error: float
    result_dtypes: tuple[str, ...]
    note: str = ""  # why the row is not what it seems: a failure, or nothing converted
    failed: bool = False


@dataclass(frozen=True, repr=False)
class Comparison(TableView):
    """The result of `compare`: one Row per mode, the 32-true reference first."""

    device: str
    repeat: int
    warmup: int
    rows: tuple[Row, ...]
    why: str = ""  # why the device was chosen, e.g. "where the model's parameters are"

    @property
    def reference(self) -> Row:
        """The 32-true run with TF32 off (IEEE fp32) that speedups and errors are against."""
        return self.rows[0]

    def row(self, mode: str) -> Row:
        """The last row of a mode (any name or alias get_mode accepts)."""
        name = get_mode(mode).name
        found = [r for r in self.rows if r.mode == name]
        if not found:
            raise ValueError(f"mode {name!r} was not compared; compared: {', '.join(self.labels)}")
        return found[-1]

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(r.label for r in self.rows)

    def table(self) -> Table:
        """The comparison as an ampnb Table."""
        noted = any(r.note for r in self.rows)
        rows = []
        for r in self.rows:
            if r.failed:
                cells = [r.label, "failed", *["-"] * 6]
            else:
                cells = [r.label, format_seconds(r.seconds), f"{r.speedup:.2f}x",
                         format_bytes(r.saved_bytes), format_bytes(r.peak_bytes),
                         _err(r.max_abs_error), _err(r.rel_error), ", ".join(r.result_dtypes) or "-"]
            rows.append((*cells, r.note) if noted else tuple(cells))
        why = f" ({self.why})" if self.why else ""
        caption = (f"on {self.device}{why}: median of {self.repeat} runs after {self.warmup} "
                   f"warm-up, device synchronised; errors against {REFERENCE} (TF32 off)")
        notes = ["activations saved: peak bytes autograd held for backward (memory_meter; "
                 "parameters excluded); peak: CUDA peak allocated beyond the start"]
        return Table(("mode", "median", "speedup", "activations saved", "peak", "max abs err",
                      "rel err", "result dtype", *(("note",) if noted else ())), rows,
                     caption=caption, notes=notes)


def _err(x: float) -> str:
    return "0" if x == 0 else f"{x:.2e}"


def leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in a result (tensors, numbers, modules' state, any container) by path."""
    for path, leaf in named_leaves(obj, prefix):
        if isinstance(leaf, torch.Tensor):
            yield path, leaf.detach()
        elif isinstance(leaf, torch.nn.Module):
            yield from leaves(dict(leaf.state_dict()), path)
        elif isinstance(leaf, (int, float)) and not isinstance(leaf, bool):
            yield path, torch.tensor(float(leaf), dtype=torch.float64)


def kept(value: Any) -> dict[str, torch.Tensor]:
    """A result's tensors by path, copied: what later runs or restores cannot change."""
    return {k: v.clone() for k, v in leaves(value)}


def errors(result: Any, reference: Any) -> tuple[float, float]:
    """(max abs error, relative L2 error) of result's float tensors against reference's."""
    ref = {k: v for k, v in leaves(reference) if v.is_floating_point()}
    got = {k: v for k, v in leaves(result) if v.is_floating_point()}
    common = [k for k in ref if k in got and got[k].shape == ref[k].shape]
    if not common:
        return math.nan, math.nan
    worst, diff2, ref2 = 0.0, 0.0, 0.0
    for k in common:
        r = ref[k].to(torch.float64)
        d = got[k].to(device=r.device, dtype=torch.float64) - r
        if d.numel():
            m = d.abs().max().item()
            worst = math.nan if math.isnan(m) or math.isnan(worst) else max(worst, m)
        diff2 += d.square().sum().item()
        ref2 += r.square().sum().item()
    rel = math.sqrt(diff2) / math.sqrt(ref2) if ref2 else (0.0 if diff2 == 0 else math.inf)
    return worst, rel


def dtypes(result: Any) -> tuple[str, ...]:
    """The floating dtypes in a result, sorted."""
    found = {str(v.dtype).removeprefix("torch.") for _, v in leaves(result) if v.is_floating_point()}
    return tuple(sorted(found))
