"""PrecisionPanel: one mode switch + one Step click on the demo model, redraw included."""

from __future__ import annotations

import itertools
import statistics
import time

import torch

from benchmarks._common import Result, median_time, ms, one_thread

REPEAT, WARMUP = 15, 3
GOAL_S = 0.150
# The modes a CPU runs at full speed; fp16 there is a ~100x slower fallback (timed separately).
CYCLE = ("32-true", "bf16-mixed", "bf16-true")


def _panel(device: str):
    """The default panel (demo MLP) in an InteractiveShell, so display() renders the PNG."""
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    from ampnb.models import demo
    from ampnb.panels import PrecisionPanel
    from ampnb.workbench import Workbench

    InteractiveShell.instance()
    with capture_output():
        return PrecisionPanel(Workbench(*demo("mlp", seed=0, device=device)))


def _render_floor() -> float:
    """This machine's cost of one PNG of a 3-point line, figure set up as the panel's."""
    from ampnb.panels.precision_panel import _FIGSIZE, _MARGINS
    from ampnb.plots._axes import new_axes

    ax = new_axes(figsize=_FIGSIZE)
    ax.figure.set_layout_engine(None)
    ax.figure.subplots_adjust(**_MARGINS)
    ax.plot([0, 1, 2], [1.0, 0.5, 0.25])
    return median_time(ax.figure._repr_png_, repeat=REPEAT, warmup=WARMUP)


def _switch_and_step(panel, mode: str) -> tuple[float, float]:
    """Wall time of setting the mode dropdown, then of clicking Step (each with its redraw)."""
    from IPython.utils.capture import capture_output

    with capture_output():
        t0 = time.perf_counter()
        panel.mode.value = mode
        t1 = time.perf_counter()
        panel.buttons["Step"].click()
        t2 = time.perf_counter()
    if "color:#b00" in panel.message.value:  # the panel showed an error: the timing is void
        raise RuntimeError(f"the panel reported an error: {panel.message.value[:300]}")
    return t1 - t0, t2 - t1


def _measure(panel, modes: tuple[str, ...], repeat: int, warmup: int) -> dict[str, float]:
    cycle = itertools.cycle(modes)
    next(cycle)  # the panel starts in the first mode: switch away from it first
    for _ in range(warmup):
        _switch_and_step(panel, next(cycle))
    switch, step = [], []
    for _ in range(repeat):
        a, b = _switch_and_step(panel, next(cycle))
        switch.append(a)
        step.append(b)
    total = [a + b for a, b in zip(switch, step)]
    return {"total": statistics.median(total), "switch": statistics.median(switch),
            "step": statistics.median(step)}


def run() -> list[Result]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with one_thread():
        panel = _panel(device)
        found = _measure(panel, CYCLE, REPEAT, WARMUP)
        floor = _render_floor()
        fp16 = _measure(panel, ("32-true", "16-mixed"), repeat=3, warmup=1)
    traced = "with" if panel.ops.value else "without"
    return [
        Result(f"PrecisionPanel mode switch + Step (demo mlp, {device}, {'/'.join(CYCLE)}, "
               f"{traced} op trace, 1 thread)",
               f"{ms(found['total'])} median of {REPEAT} (switch {ms(found['switch'])}, "
               f"step + redraw {ms(found['step'])})", found["total"],
               f"<= {GOAL_S * 1e3:.0f} ms", found["total"] <= GOAL_S),
        Result("  machine floor: one PNG of a bare 3-point plot, same figure size",
               f"{ms(floor)} median of {REPEAT}; panel / floor", found["total"] / floor,
               "reported", None),
        Result(f"PrecisionPanel 32-true <-> 16-mixed switch + Step (demo mlp, {device})",
               f"{ms(fp16['total'])} median of 3", fp16["total"],
               "reported (fp16 is a slow fallback on CPUs)", None),
    ]
