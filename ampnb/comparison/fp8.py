"""The same model trained under 32-true, bf16-mixed and emulated FP8: losses side by side.

A runner on the one step, so it sits above `ampnb.modes` (whose Transformer Engine modes import
`ampnb.fp8`); `ampnb.fp8.side_by_side` is this function.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ampnb.batch import Batch, as_batch
from ampnb.display import Table, TableView
from ampnb.fp8.convert import Fp8Report, convert_to_fp8
from ampnb.fp8.recipe import Fp8Recipe, from_recipe_name
from ampnb.fp8.stats import Fp8Stats
from ampnb.modes import get_mode
from ampnb.precision import Precision
from ampnb.putback import rng_kept
from ampnb.putback import seed as putback_seed
from ampnb.start import Start
from ampnb.step import StepSettings, step_context

# run name -> (converts to FP8?, the mode its steps run under). FP8 runs keep bf16 autocast
# for every other op, as Lightning's Transformer Engine plugin does with its fallback autocast.
RUNS: dict[str, tuple[bool, str]] = {
    "32-true": (False, "32-true"),
    "bf16-mixed": (False, "bf16-mixed"),
    "fp8": (True, "bf16-mixed"),
}


@dataclass(frozen=True, repr=False)
class SideBySide(TableView):
    """Loss per step for each run, and the FP8 run's per-layer output SQNR against fp32."""

    losses: dict[str, tuple[float, ...]]
    recipe: Fp8Recipe
    report: Fp8Report | None = None
    stats: Fp8Stats | None = field(default=None, compare=False)

    def sqnr_by_layer(self) -> dict[str, float]:
        return self.stats.sqnr_by_layer() if self.stats else {}

    def table(self, last: int = 20) -> Table:
        """Mean loss over the last steps of each run, and its gap to 32-true."""
        means = {k: sum(v[-last:]) / len(v[-last:]) for k, v in self.losses.items()}
        ref = means.get("32-true")
        rows = [(k, len(self.losses[k]), f"{m:.4f}", "-" if ref is None else f"{m - ref:+.4f}")
                for k, m in means.items()]
        return Table(("run", "steps", f"mean loss, last {last}", "vs 32-true"), rows,
                     caption=f"FP8 recipe: {self.recipe.describe()}")


@dataclass(frozen=True)
class _Work:
    """A model, its optimizer, its loss_fn and the batches one run steps through."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[..., torch.Tensor] | None
    batches: list[Batch]


def _train(work: _Work, run: str, steps: int, device: str, recipe: Fp8Recipe, seed: int,
           watch: bool) -> tuple[list[float], Fp8Report | None, Fp8Stats | None]:
    to_fp8, mode_name = RUNS[run]
    model, opt = work.model, work.optimizer
    report = stats = None
    if to_fp8:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the report lists skipped layers instead
            model, report = convert_to_fp8(model, recipe, backend="ampnb", inplace=True)
        stats = Fp8Stats(model) if watch else None
    losses = []
    p = Precision.of(mode_name, device=device)
    # Same seed for every run: dropout draws the same masks, and the caller's RNG is kept.
    with rng_kept():
        putback_seed(seed, device)
        try:
            with step_context(StepSettings(p)):
                for b in itertools.islice(itertools.cycle(work.batches), steps):
                    done = p.step(model, opt, b, work.loss_fn)
                    losses.append(done.loss.item())
        finally:
            if stats is not None:
                stats.detach()
    return losses, report, stats


def _work(model: Any, batch: Any, loss_fn: Any, optimizer: Any, seed: int, device: str,
          demo_kw: dict[str, Any]) -> Callable[[], _Work]:
    """A maker of fresh, identical work for each run, from a demo name or a user's model."""
    if isinstance(model, str):
        from ampnb.models import demo

        if batch is not None or loss_fn is not None or optimizer is not None:
            raise ValueError("a demo brings its own batches, loss_fn and optimizer; "
                             "pass a model to use yours")

        def from_demo() -> _Work:
            d = demo(model, seed=seed, device=device, **demo_kw)
            return _Work(d.model, d.optimizer, d.loss_fn,
                         [as_batch(b, d.loss_fn) for b in d.batches])
        return from_demo
    if not isinstance(model, nn.Module):
        raise ValueError(f"model={model!r} is not allowed; allowed: an nn.Module or a demo name")
    if demo_kw:
        raise ValueError(f"{', '.join(demo_kw)} only apply to a demo name, not to a model")
    b = as_batch(batch, loss_fn).to(device)
    start = Start.take(model, optimizer)  # one snapshot; None: AdamW(lr=1e-3)

    def from_model() -> _Work:
        m, opt = start.copy(get_mode("32-true"), device)
        return _Work(m, opt, loss_fn, [b])
    return from_model


def side_by_side(model: nn.Module | str = "gpt", batch: Any = None, loss_fn: Any = None, *,
                 optimizer: torch.optim.Optimizer | None = None, steps: int = 200,
                 runs: tuple[str, ...] = tuple(RUNS), recipe: Fp8Recipe | str | None = None,
                 seed: int = 0, watch: bool = True, device: str = "cpu",
                 **demo_kw: Any) -> SideBySide:
    """Train identical copies (same start, same batches, same seed) under each run.

    `model` is a demo name (with its batches, loss_fn, optimizer and `demo_kw`) or your own
    model with one `batch` (as `ampnb.batch.as_batch` reads it), a `loss_fn` (None: the model's
    own loss) and an `optimizer` instance over its parameters (None: AdamW, lr 1e-3). Your
    model and optimizer are deep-copied for each run and never changed.
    """
    unknown = [r for r in runs if r not in RUNS]
    if unknown:
        raise ValueError(f"unknown run {unknown[0]!r}; allowed: {', '.join(RUNS)}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r} is not allowed; allowed: an integer >= 1")
    r = from_recipe_name(recipe)
    fresh = _work(model, batch, loss_fn, optimizer, seed, device, demo_kw)
    losses, report, stats = {}, None, None
    for run in runs:
        losses[run], rep, st = _train(fresh(), run, steps, device, r, seed, watch)
        report, stats = rep or report, st or stats
    return SideBySide({k: tuple(v) for k, v in losses.items()}, r, report, stats)
