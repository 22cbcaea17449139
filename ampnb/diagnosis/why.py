"""`profile_step`: why a mode is (not) faster on this machine, on its own (`%%amp --profile`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampnb.batch import as_batch
from ampnb.device import get_device, place_model, support_table
from ampnb.diagnosis.candidates import candidates
from ampnb.diagnosis.failures import expected
from ampnb.diagnosis.profile import Profile, profile_run
from ampnb.diagnosis.run import Setup, measure
from ampnb.display import Table, TableView, format_percent, format_seconds
from ampnb.putback_state import globals_kept
from ampnb.start import started


@dataclass(frozen=True, repr=False)
class Profiles(TableView):
    """One profile per mode, the reference first, and the machine's support table."""

    device: str
    profiles: tuple[Profile, ...]
    support: Table

    def table(self) -> Table:
        ref = self.profiles[0].total_s
        rows = [(p.name, p.how.split(";")[0], format_seconds(p.total_s),
                 f"{ref / p.total_s:.2f}x" if p.total_s else "-", format_percent(p.cast_share),
                 ", ".join(f"{k} {format_percent(v / p.total_s)}" for k, v in
                           sorted(p.by_dtype.items(), key=lambda kv: -kv[1])
                           if p.total_s and v / p.total_s >= 0.01),
                 len(p.unaligned)) for p in self.profiles]
        return Table(("mode", "runs here", "op time", "vs 32-true", "casts", "op time by dtype",
                      "unaligned matmuls"), rows,
                     caption=f"why each mode is (not) faster on {self.device}: one step under "
                             "torch.profiler (self time of aten ops)",
                     notes=[f"{p.name}: {p.why}" for p in self.profiles])

    def _repr_html_(self) -> str:
        return self.table()._repr_html_() + self.support._repr_html_()


def profile_step(model: nn.Module, batch: Any, loss_fn: Callable[..., Any] | None = None, *,
                 optimizer: torch.optim.Optimizer | None = None, device: str | None = None,
                 modes: Iterable[str] | str | None = ("32-true", "bf16-mixed", "16-mixed"),
                 seed: int = 0, step: Callable[[nn.Module], Any] | None = None) -> Profiles:
    """Profile one training step per mode on a copy: op time by dtype, casts, unaligned matmuls."""
    from ampnb.diagnosis.arguments import check_model, check_options

    check_model(model, optimizer, 1)
    check_options(loss_fn, device, modes, seed)
    dev = get_device(place_model(model, device).device).name  # as the doctor places it
    cands, _ = candidates(modes, dev)
    data = as_batch(batch, loss_fn).to(dev) if step is None else as_batch(())
    found = []
    with globals_kept(), started(model, optimizer) as start:
        setup = Setup(start, data, loss_fn, dev, seed, step)
        name = type(model).__name__
        for i, cand in enumerate(cands):  # the reference first: torch's errors explained there
            with expected(setup.batch, name, step is not None) if i == 0 else nullcontext():
                scale = measure(setup, cand).scale if cand.mode.uses_scaler else None
                found.append(profile_run(setup, cand, scale))
    return Profiles(dev, tuple(found), support_table())
