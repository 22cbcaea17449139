"""The scale-history and gradient-scaling plots draw exactly what the stepper recorded."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_scaler import make

from ampnb.formats import get_format
from ampnb.plots import plot_grad_scaling, plot_scale_history, plot_step_gradients
from ampnb.plots._axes import new_axes
from ampnb.scaler import ScalerStepper


@pytest.fixture(scope="module")
def stepper():
    model, opt, loss_fn, batches = make()
    s = ScalerStepper(model, opt, loss_fn, batches, init_scale=2.0**6, growth_interval=2)
    s.run(3)
    s.inject("inf")
    s.run(4)
    return s


def test_scale_history_draws_the_recorded_scales(stepper):
    ax = plot_scale_history(stepper)
    history = stepper.history
    line = ax.get_lines()[0]
    assert list(line.get_ydata()) == [r.scale for r in history] + [history[-1].new_scale]
    skipped, grew = ax.collections[0], ax.collections[1]
    assert [tuple(p) for p in skipped.get_offsets()] == [(r.step, r.scale) for r in history
                                                         if r.skipped]
    assert len(grew.get_offsets()) == sum(r.new_scale > r.scale for r in history) > 0
    tracker = [a for a in ax.figure.axes if a is not ax][0]
    dashed = [ln for ln in tracker.get_lines() if ln.get_linestyle() == "--"]
    assert dashed and dashed[0].get_ydata()[0] == stepper.settings.growth_interval
    assert ax.get_yscale() == "log"


def test_scale_history_from_records_and_empty():
    model, opt, loss_fn, batches = make()
    s = ScalerStepper(model, opt, loss_fn, batches)
    ax = plot_scale_history(s)
    assert [t.get_text() for t in ax.texts] == ["no steps yet"]
    records = s.run(2)
    ax = plot_scale_history(records, ax=new_axes(), growth_interval=5)
    assert len(ax.get_lines()[0].get_ydata()) == 3


def test_grad_scaling_histogram_counts_and_fp16_limits(stepper):
    ax = plot_grad_scaling(stepper)
    fp16 = get_format("fp16")
    scaled = stepper.last_grads["scaled"]
    expected = int((torch.isfinite(scaled) & (scaled != 0)).sum())
    heights = [sum(p.get_height() for p in c) for c in ax.containers]
    assert heights[1] == expected  # the scaled histogram holds every finite nonzero gradient
    xs = sorted(ln.get_xdata()[0] for ln in ax.get_lines())
    assert xs == [math.log2(fp16.smallest_subnormal), math.log2(fp16.smallest_normal),
                  math.log2(fp16.max)]
    # Scaled and unscaled log2 histograms are the same shape shifted by log2(scale).
    shift = np.median(torch.log2(scaled.abs()[scaled != 0]).numpy()) - np.median(
        torch.log2(stepper.last_grads["unscaled"].abs()[scaled != 0]).numpy())
    assert shift == pytest.approx(math.log2(stepper.history[-1].scale))


def test_step_gradients_shift_by_exactly_log2_of_the_scale(stepper):
    ax = plot_step_gradients(stepper)
    hist = {p.get_gid(): p.get_data().values for p in ax.patches if p.get_gid() in ("before", "after")}
    unscaled = stepper.last_grads["unscaled"]
    _, exponent = torch.frexp(unscaled[unscaled != 0])
    first = int(next(p for p in ax.patches if p.get_gid() == "before").get_data().edges[0])
    expected = torch.bincount((exponent - 1 - first).long(), minlength=len(hist["before"]))
    assert np.array_equal(hist["before"], expected.numpy())
    shift = int(math.log2(stepper.last_grads["scale"]))  # a power of two: whole binades
    assert np.array_equal(hist["after"][shift:], hist["before"][:-shift])
