"""The same demo model trained under 32-true, bf16-mixed and emulated FP8: losses side by side."""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ampnb.display import Table
from ampnb.fp8.convert import Fp8Report, convert_to_fp8
from ampnb.fp8.recipe import Fp8Recipe, from_recipe_name
from ampnb.fp8.stats import Fp8Stats


def _fp32(model: nn.Module, device: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def _bf16(model: nn.Module, device: str) -> contextlib.AbstractContextManager:
    return torch.autocast(device, dtype=torch.bfloat16)


# run name -> (converts to FP8?, forward context). FP8 runs keep bf16 autocast for every
# other op, as Lightning's Transformer Engine plugin does with its fallback autocast.
RUNS: dict[str, tuple[bool, Callable[[nn.Module, str], Any]]] = {
    "32-true": (False, _fp32),
    "bf16-mixed": (False, _bf16),
    "fp8": (True, _bf16),
}


@dataclass(frozen=True)
class SideBySide:
    """Loss per step for each run, and the FP8 run's per-layer output SQNR against fp32."""

    losses: dict[str, tuple[float, ...]]
    recipe: Fp8Recipe
    report: Fp8Report | None = None
    stats: Fp8Stats | None = field(default=None, compare=False, repr=False)

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

    def _repr_html_(self) -> str:
        return self.table()._repr_html_()


def _train(demo: Any, run: str, steps: int, device: str, recipe: Fp8Recipe,
           watch: bool) -> tuple[list[float], Fp8Report | None, Fp8Stats | None]:
    to_fp8, context = RUNS[run]
    model, opt, loss_fn, batches = demo
    report = stats = None
    if to_fp8:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the report lists skipped layers instead
            model, report = convert_to_fp8(model, recipe, inplace=True)
        stats = Fp8Stats(model) if watch else None
    losses = []
    try:
        for x, y in itertools.islice(itertools.cycle(batches), steps):
            with context(model, device):
                loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
    finally:
        if stats is not None:
            stats.detach()
    return losses, report, stats


def side_by_side(demo_name: str = "gpt", steps: int = 200, runs: tuple[str, ...] = tuple(RUNS),
                 recipe: Fp8Recipe | str | None = None, seed: int = 0, watch: bool = True,
                 device: str = "cpu", **demo_kw: Any) -> SideBySide:
    """Train identical copies (same seed, same batches) of a demo under each run."""
    from ampnb.models import demo

    unknown = [r for r in runs if r not in RUNS]
    if unknown:
        raise ValueError(f"unknown run {unknown[0]!r}; allowed: {', '.join(RUNS)}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r} is not allowed; allowed: an integer >= 1")
    r = from_recipe_name(recipe)
    losses, report, stats = {}, None, None
    for run in runs:
        d = demo(demo_name, seed=seed, device=device, **demo_kw)
        losses[run], rep, st = _train(d, run, steps, device, r, watch)
        report, stats = rep or report, st or stats
    return SideBySide({k: tuple(v) for k, v in losses.items()}, r, report, stats)
