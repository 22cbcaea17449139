"""matplotlib figures (object API: `ax=` in, `Axes` out; no pyplot state, no global style)."""

from __future__ import annotations

from ampnb._lazy import lazy_exports

# Public plot name -> module. Each module draws from data computed by the pure core.
_EXPORTS = {
    "plot_format_ladder": "ampnb.plots.ranges",
    "plot_tensor_histogram": "ampnb.plots.ranges",
    "plot_layer_summary": "ampnb.plots.ranges",
    "plot_loss_scale_effect": "ampnb.plots.ranges",
    "plot_scale_history": "ampnb.plots.scale",
    "plot_grad_scaling": "ampnb.plots.scale",
    "plot_step_gradients": "ampnb.plots.scale",
    "plot_loss_curve": "ampnb.plots.training",
    "plot_fp8_scaling": "ampnb.plots.fp8",
    "plot_lowbit_grid": "ampnb.plots.fp8",
    "plot_side_by_side": "ampnb.plots.fp8",
    "plot_optimizer_losses": "ampnb.plots.lowbit",
    "plot_reduction_error": "ampnb.plots.reduction",
    "plot_what_if": "ampnb.plots.what_if",
    "plot_block_flush": "ampnb.plots.blocks",
    "plot_block_histogram": "ampnb.plots.blocks",
    "plot_blocks": "ampnb.plots.blocks",
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
