"""FP8 / low-bit plots: limits drawn from format bits, code values from the code book."""

from __future__ import annotations

import math

import pytest
import torch
from matplotlib.axes import Axes
from torch import nn

from ampnb.fp8 import DelayedScaling, Fp8Linear, Fp8Stats, get_lowbit
from ampnb.plots import plot_fp8_scaling, plot_lowbit_grid, plot_side_by_side
from ampnb.plots._axes import new_axes


def watched():
    torch.manual_seed(0)
    model = nn.Sequential(Fp8Linear(16, 16, recipe=DelayedScaling(amax_history_len=2)))
    stats = Fp8Stats(model)
    for k in range(4):
        model(torch.randn(4, 16) * 4.0**k).sum().backward()
    stats.detach()
    return stats


@pytest.mark.parametrize(("role", "dtype"), [("input", torch.float8_e4m3fn),
                                             ("grad_output", torch.float8_e5m2)])
def test_scaling_plot_draws_the_format_limits_and_where_amax_landed(role, dtype):
    stats = watched()
    ax = plot_fp8_scaling(stats, "0", role)
    assert isinstance(ax, Axes)
    levels = sorted(line.get_ydata()[0] for line in ax.lines if len(line.get_ydata()) == 2
                    and line.get_ydata()[0] == line.get_ydata()[1])
    fi = torch.finfo(dtype)
    mant = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}[dtype]
    assert levels == [math.log2(fi.smallest_normal) - mant, math.log2(fi.smallest_normal),
                      math.log2(fi.max)]
    landed = [r.scaled_amax for r in stats.series("0", role)]
    assert list(ax.lines[3].get_ydata()) == [math.log2(v) for v in landed]


def test_scaling_plot_rejects_an_unknown_layer_and_reuses_a_given_axes():
    stats = watched()
    with pytest.raises(ValueError, match="layer 'nope'.*layers: 0"):
        plot_fp8_scaling(stats, "nope")
    ax = new_axes()
    assert plot_fp8_scaling(stats, "0", "weight", ax=ax) is ax


@pytest.mark.parametrize("fmt", ["nf4", "fp4"])
def test_lowbit_grid_marks_every_code_value(fmt):
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    ax = plot_lowbit_grid(w, fmt)
    xs = [line.get_xdata()[0] for line in ax.lines]
    assert xs == get_lowbit(fmt).codebook().tolist()
    assert f"{get_lowbit(fmt).bits_per_param(w.shape):.3f}" in ax.get_title()
    heights = sum(p.get_height() for p in ax.patches)
    assert heights == w.numel()


def test_side_by_side_plot_has_one_line_per_run():
    from types import SimpleNamespace

    result = SimpleNamespace(losses={"32-true": (3.0, 2.0, 1.0), "fp8": (3.0, 2.5, 1.5)})
    ax = plot_side_by_side(result, smooth=2)
    assert [line.get_label() for line in ax.lines] == ["32-true", "fp8"]
    assert list(ax.lines[0].get_ydata()) == [2.5, 1.5]
