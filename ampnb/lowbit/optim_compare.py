"""The demo GPT trained with fp32 Adam and with 8-bit Adam: loss curves and optimizer-state bytes."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampnb.display import Table, TableView, format_bytes
from ampnb.instruments.memory import measure_memory
from ampnb.lowbit.optim import MIN_8BIT_SIZE, Adam8bit, param_groups
from ampnb.precision import Precision
from ampnb.putback import rng_kept
from ampnb.putback import seed as putback_seed
from ampnb.step import StepSettings, step_context

Factory = Callable[[nn.Module, float], torch.optim.Optimizer]

# The runs Lightning's page suggests comparing: plain Adam, Adam8bit, Adam8bit with the
# embeddings' state kept in 32 bits.
RUNS: dict[str, Factory] = {
    "Adam (fp32 state)": lambda m, lr: torch.optim.Adam(m.parameters(), lr=lr),
    "Adam8bit": lambda m, lr: Adam8bit(m.parameters(), lr=lr),
    "Adam8bit, embeddings 32-bit": lambda m, lr: Adam8bit(param_groups(m, (nn.Embedding,)), lr=lr),
}


@dataclass(frozen=True, repr=False)
class OptimizerComparison(TableView):
    """Losses per step and optimizer-state bytes (ampnb's memory meter) of each run."""

    losses: dict[str, tuple[float, ...]]
    state_bytes: dict[str, int]
    eight_bit: dict[str, tuple[str, ...]]  # parameters whose state is 8-bit, per run
    n_params: int
    notes: tuple[str, ...] = ()  # why rows agree where they do

    def table(self) -> Table:
        base = next(iter(self.state_bytes.values()))
        rows = []
        for run, losses in self.losses.items():
            tail = losses[-10:]
            rows.append((run, format_bytes(self.state_bytes[run]), f"{self.state_bytes[run] / base:.3f}",
                         f"{self.state_bytes[run] / self.n_params:.2f}", str(len(self.eight_bit[run])),
                         f"{losses[0]:.4f}", f"{sum(tail) / len(tail):.4f}"))
        return Table(("run", "optimizer state", "vs first", "bytes/param", "8-bit tensors",
                      "first loss", "last-10 mean loss"), rows,
                     caption="same model, same batches, same seed: Adam's state in 32 vs 8 bits",
                     notes=("optimizer state measured by ampnb.instruments.memory after one step",
                            *self.notes))


def compare_optimizers(name: str = "gpt", steps: int = 150, *, lr: float | None = None, seed: int = 0,
                       runs: dict[str, Factory] | None = None, **demo_kw: Any) -> OptimizerComparison:
    """Train identical copies of a demo under each optimizer; measure its state with the memory meter."""
    from ampnb.models import demo
    from ampnb.models.demos import DEMOS

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r} is not allowed; allowed: an integer >= 1")
    runs = RUNS if runs is None else runs
    losses, sizes, eight = {}, {}, {}
    for run, make in runs.items():
        d = demo(name, seed=seed, **demo_kw)
        rate = DEMOS[name].lr if lr is None else lr
        opt = make(d.model, rate)
        sizes[run] = measure_memory(d.model, d.batches[0], d.loss_fn, optimizer=opt).optimizer_bytes
        names = {id(p): n for n, p in d.model.named_parameters()}
        eight[run] = tuple(names[id(p)] for g in opt.param_groups for p in g["params"]
                           if isinstance(opt, Adam8bit) and opt.is_8bit(p, g))
        curve = []
        p = Precision.of("32-true", model=d.model)  # where place_model says the demo is
        with rng_kept(), step_context(StepSettings(p)):
            putback_seed(seed, p.device)  # same dropout masks in every run
            for b in itertools.islice(itertools.cycle(d.batches), steps):
                done = p.step(d.model, opt, b, d.loss_fn)
                curve.append(done.loss.item())
        losses[run] = tuple(curve)
    return OptimizerComparison(losses, sizes, eight, d.n_params, _same_state(eight, d.model))


def _same_state(eight: dict[str, tuple[str, ...]], model: nn.Module) -> tuple[str, ...]:
    """Say why two runs keep the same tensors in 8 bits (their rows then agree), from the sizes."""
    notes = []
    runs = [r for r, names in eight.items() if names]
    small = [(n, p.numel()) for n, p in model.named_parameters() if p.numel() < MIN_8BIT_SIZE]
    for a, b in itertools.combinations(runs, 2):
        if set(eight[a]) == set(eight[b]):
            some = ", ".join(f"{n} ({k:,} values)" for n, k in small[:3])
            notes.append(f"{a!r} and {b!r} keep the same {len(eight[a])} tensors in 8 bits, so "
                         f"their rows agree: tensors under min_8bit_size={MIN_8BIT_SIZE:,} keep "
                         f"fp32 state in every Adam8bit run ({some}{', ...' if len(small) > 3 else ''})")
    return tuple(notes)
