"""The block views: per-block flushed shares (tensorwise FP8 vs MXFP8) and their plots."""

from __future__ import annotations

import pytest
import torch

import ampnb
from ampnb.whatif.blocks import block_stats


def outlier_tensor() -> torch.Tensor:
    x = ((torch.arange(256) * 37 % 101 - 50) / 17).reshape(4, 64)  # exact, any CPU
    x[1, 40] = 1e7  # in block 3 (row 1, second block of 32)
    return x


def test_one_outlier_costs_one_block_in_mxfp8_and_the_tensor_in_fp8():
    x = outlier_tensor()
    s = block_stats(x, "mxfp8_e4m3")
    assert len(s.flushed) == 8 and s.block_size == 32
    # by hand: tensorwise scale 448/1e7 puts |x| <= 50/17 below e4m3's 2**-9 / 2: all flushed
    assert all(v == 1.0 for i, v in enumerate(s.flushed_tensorwise) if i != 3)
    assert s.flushed[3] > 0.9 and all(v == 0 for i, v in enumerate(s.flushed) if i != 3)
    # the outlier's block: scale 2**(floor(log2 1e7) - 8) = 2**15
    assert s.log2_scale[3] == 23 - 8
    y = ampnb.quantize(x, "mxfp8_e4m3")
    block = (x[1, 32:] != 0) & (y[1, 32:] == 0)
    assert s.flushed[3] == block.sum().item() / (x[1, 32:] != 0).sum().item()


def test_plots_return_axes():
    matplotlib = pytest.importorskip("matplotlib")
    from ampnb.plots import plot_block_flush, plot_block_histogram, plot_blocks

    x = outlier_tensor()
    ax = plot_block_flush(x)
    assert isinstance(ax, matplotlib.axes.Axes) and len(ax.patches) == 16
    assert isinstance(plot_block_histogram(x, "nvfp4"), matplotlib.axes.Axes)
    top, bottom = plot_blocks(x, "mxfp4")
    assert top.figure is bottom.figure
    with pytest.raises(ValueError, match="block-scaled"):
        block_stats(x, "bf16")


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "nvfp4"])
def test_tensor_histogram_accepts_a_block_format_and_draws_its_block_bands(fmt):
    pytest.importorskip("matplotlib")
    from ampnb.plots import plot_tensor_histogram

    x = outlier_tensor()
    ax = plot_tensor_histogram(x, (fmt,))
    s = block_stats(x, fmt)
    lo_e, hi_e = s.element_binades
    scales = sorted({v for v in s.log2_scale if v == v})
    bands = [p for p in ax.patches if (p.get_gid() or "").startswith(f"{fmt}:block")]
    assert len(bands) == len(scales)
    xs = sorted(round(p.get_x(), 6) for p in bands)
    assert xs == sorted(round(lo_e + sc, 6) for sc in scales)


def test_tensor_histogram_block_format_needs_the_tensor():
    pytest.importorskip("matplotlib")
    from ampnb.instruments.summaries import summarize
    from ampnb.plots import plot_tensor_histogram

    stats = summarize(outlier_tensor(), ("fp16",))
    with pytest.raises(ValueError, match="mxfp4"):
        plot_tensor_histogram(stats, ("mxfp4",))
