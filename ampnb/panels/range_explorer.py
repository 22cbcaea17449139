"""RangeExplorer: pick a layer, a tensor kind and formats; see where its values fall."""

from __future__ import annotations

import html
from collections.abc import Iterable
from typing import Any

import ipywidgets as widgets
import torch
from torch import nn

from ampnb.batch import as_batch, model_loss
from ampnb.block_formats import BLOCK_FORMATS
from ampnb.formats import get_format
from ampnb.instruments.coverage_stats import coverage_table
from ampnb.instruments.summaries import DEFAULT_FORMATS
from ampnb.instruments.tensor_capture import Capture, capture
from ampnb.models import Demo
from ampnb.panels.base import Panel
from ampnb.plots._axes import new_axes
from ampnb.plots.blocks import plot_blocks
from ampnb.plots.ranges import RANGE_FORMATS, plot_layer_summary, plot_tensor_histogram
from ampnb.precision import Precision
from ampnb.putback import untouched
from ampnb.step import StepSettings, forward_loss, step_context

ALL = "(all layers)"
_SIZES = {"histogram": (8.0, 3.4), "summary_row": 0.28, "blocks": (8.0, 6.0)}
# Fixed margins instead of constrained layout: that lays out by drawing every label once more,
# which doubled the cost of the first view on models with a hundred tensors (inches).
_MARGIN_IN = {"left": 0.7, "right": 0.2, "bottom": 0.75, "top": 0.45, "legend": 0.3}
_LABEL_IN = 7 * 0.55 / 72  # width of one character of a 7-point tick label


def _own_loss(output: Any, _targets: Any) -> torch.Tensor | None:
    """The model's own loss, or None: a model without one still shows its activations."""
    return model_loss(output)


def _pick_formats(formats: Iterable[str], shown: Iterable[str] | None, blocks: Iterable[str]
                  ) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(per-tensor formats, shown ones, block formats): block names in formats join blocks."""
    formats = (formats,) if isinstance(formats, str) else tuple(formats)
    blocks = (blocks,) if isinstance(blocks, str) else tuple(blocks)
    bad = [b for b in blocks if b not in BLOCK_FORMATS]
    if bad:
        raise ValueError(f"blocks={bad[0]!r} is not a block-scaled format; allowed: "
                         f"{', '.join(BLOCK_FORMATS)}")
    blocks += tuple(f for f in formats if f in BLOCK_FORMATS and f not in blocks)
    names = tuple(get_format(f).name for f in formats if f not in BLOCK_FORMATS)
    if not names:
        raise ValueError(f"formats={formats!r} needs at least one per-tensor format, e.g. "
                         f"'fp16'; block formats alone go in blocks=")
    if shown is None:  # the usual three where captured, else the first three captured
        shown = [f for f in RANGE_FORMATS if f in names] or names[:3]
    shown = tuple(get_format(f).name for f in shown)
    missing = [f for f in shown if f not in names]
    if missing:
        raise ValueError(f"shown format {missing[0]!r} is not among formats; allowed: "
                         f"{', '.join(names)}")
    return names, shown, blocks


class RangeExplorer(Panel):
    """Layer / kind / formats pickers over one captured step; plot and coverage table follow.

    batch is any form ampnb.batch takes (positional, a keyword dict, or (inputs, targets) with
    a loss_fn); gradients are shown when there is a loss: loss_fn's or the model's own.
    `blocks` (block-scaled format names) adds a "block view" picker: one tensor's histogram
    against the element range at each block scale, and each block's flushed share beside
    tensorwise FP8's; the capture then keeps an exact copy of every tensor (memory).
    """

    css = "range"

    def __init__(self, model: nn.Module | Demo, batch: Any = None, loss_fn: Any = None,
                 formats: Iterable[str] = DEFAULT_FORMATS, shown: Iterable[str] | None = None,
                 modules: str | Iterable[str] = "*", blocks: Iterable[str] = ()) -> None:
        if isinstance(model, Demo):
            batch = model.batches[0] if batch is None else batch
            loss_fn = model.loss_fn if loss_fn is None else loss_fn
            model = model.model
        if not isinstance(model, nn.Module):
            raise ValueError(f"RangeExplorer needs an nn.Module or an ampnb demo, got "
                             f"{type(model).__name__}")
        if batch is not None:
            as_batch(batch, loss_fn)  # a malformed batch is refused before anything runs
        self.model, self.batch, self.loss_fn, self.modules = model, batch, loss_fn, modules
        self.formats, shown, self.blocks = _pick_formats(formats, shown, blocks)
        self.kinds = ("weight",) + (() if batch is None else ("activation", "gradient"))
        self.capture, had_loss = self._capture()
        if not had_loss:  # no loss_fn and the model gave no loss of its own
            self.kinds = tuple(k for k in self.kinds if k != "gradient")
        self._pickers(shown)
        self.recapture = widgets.Button(description="Capture again", icon="refresh",
                                        tooltip="run the batch through the model again")
        self.table = widgets.HTML()
        self._base_widgets()
        self.ax = new_axes(figsize=_SIZES["histogram"])
        self.figure = self.ax.figure
        self.figure.set_layout_engine(None)
        self._syncing = False  # True while the panel itself rewrites the layer options
        self._set_layers()
        self.kind.observe(lambda _c: self._safely(self._on_kind), names="value")
        self.layer.observe(lambda _c: self._on_pick(), names="value")
        self.format_picker.observe(lambda _c: self._on_pick(), names="value")
        self.block.observe(lambda _c: self._on_pick(), names="value")
        self.recapture.on_click(lambda _b: self._safely(self._recapture))
        self.widget = widgets.VBox([
            widgets.HBox([widgets.VBox([self.kind, self.layer, *([self.block] if self.blocks
                                                                   else []), self.recapture]),
                          self.format_picker]),
            self.message, self.out, self.table])
        self._classes({"panel": self.widget, "layer": self.layer, "kind": self.kind,
                       "formats": self.format_picker, "plot": self.out, "table": self.table,
                       "message": self.message})
        self._safely(self._note)

    def _pickers(self, shown: tuple[str, ...]) -> None:
        """The kind, layer, formats and block view pickers."""
        style = {"description_width": "initial"}
        self.kind = widgets.Dropdown(options=self.kinds, value=self._first_kind(),
                                     description="tensor", style=style)
        self.layer = widgets.Dropdown(description="layer", style=style,
                                      layout={"width": "340px"})
        self.format_picker = widgets.SelectMultiple(options=self.formats, value=shown,
                                                    description="formats", rows=len(self.formats),
                                                    style=style)
        self.block = widgets.Dropdown(options=[("off", None), *((b, b) for b in self.blocks)],
                                      value=None, description="block view", style=style)

    # ----- capture: one forward (+ backward) that leaves the model as it was ---------------

    def _capture(self) -> tuple[Capture, bool]:
        """Run the batch once with hooks attached, as a step's forward and backward (no update,
        no trace: the Workbench's probe); also whether there was a loss to take gradients of."""
        cap = capture(self.model, self.kinds, self.modules, self.formats, keep=bool(self.blocks))
        loss = None
        with untouched(self.model), cap:  # grads, buffers (BatchNorm stats) and RNG put back
            if self.batch is not None:
                p = Precision.of("32-true", model=self.model)  # the model as it is, where it is
                with step_context(StepSettings(p)), torch.enable_grad():
                    _, loss = forward_loss(p, self.model, as_batch(self.batch, self.loss_fn),
                                           self.loss_fn or _own_loss)
                    if loss is not None and "gradient" in self.kinds:
                        p.backward(loss)
        return cap, loss is not None

    def _first_kind(self) -> str:
        have = {r.kind for r in self.capture.records}
        return next((k for k in self.kinds if k in have), self.kinds[0])

    def layer_options(self, kind: str | None = None) -> list[str]:
        """The captured tensors of one kind, after the 'all layers' summary."""
        names = [r.name for r in self.capture.select(kind or self.kind.value)]
        return [ALL, *names] if names else []

    def _set_layers(self) -> None:
        options = self.layer_options()
        old = self.layer.value
        self._syncing = True
        try:
            self.layer.options = options
            self.layer.value = old if old in options else (options[0] if options else None)
        finally:
            self._syncing = False

    # ----- actions (errors are shown in the panel, never swallowed) ------------------------

    def _refresh(self, note: str | None) -> None:
        if note:
            self.message.value = html.escape(note)
        self._draw()

    def _on_pick(self) -> None:
        if not self._syncing:
            self._safely(self._note)

    def _on_kind(self) -> str:
        self._set_layers()
        return self._note()

    def _recapture(self) -> str:
        self.capture, _ = self._capture()
        self._set_layers()
        return f"captured again: {len(self.capture.records)} tensors"

    def _note(self) -> str:
        if "gradient" not in self.kinds:
            return ("weights only: pass batch= (and loss_fn=) to see activations and gradients"
                    if self.batch is None else
                    "no gradients: the model returned no loss; pass loss_fn= with "
                    "batch=(inputs, targets), or a batch it takes its loss from (labels=)")
        return ""

    # ----- view ------------------------------------------------------------------------

    def _draw(self) -> None:
        fmts = tuple(self.format_picker.value)
        kind, layer = self.kind.value, self.layer.value
        self.figure.clear()
        self.ax = self.figure.add_subplot(1, 1, 1)
        if layer == ALL:
            rows = self.capture.select(kind)
            self.figure.set_size_inches(8.0, _SIZES["summary_row"] * max(len(rows), 3) + 1.3)
            # Narrowest first, so each row is coloured by the smallest format that holds it.
            narrow = sorted(fmts, key=lambda n: (get_format(n).bits,
                                                 get_format(n).binades_with_subnormals))
            plot_layer_summary(rows, narrow, ax=self.ax)
            longest = max((len(f"{r.name} ({r.kind})") for r in rows), default=0)
            # The legend sits 6 % of the axes' height above them (plot_layer_summary).
            h = self.figure.get_size_inches()[1] - _MARGIN_IN["bottom"]
            self._margins(left=0.2 + longest * _LABEL_IN,
                          top=(_MARGIN_IN["top"] + _MARGIN_IN["legend"] + 0.06 * h) / 1.06)
            sp = self.figure.subplotpars  # the long x label centred on the figure, not the axes
            self.ax.xaxis.label.set_x((0.5 - sp.left) / (sp.right - sp.left))
            covs = [(f"{r.name} · {f}", r.coverage(f)) for r in rows for f in fmts]
            caption = f"every {kind} tensor against {', '.join(fmts)}"
        elif layer is None:
            self.ax.text(0.5, 0.5, f"no {kind} tensors were captured", ha="center",
                         va="center", transform=self.ax.transAxes)
            self._margins()
            covs, caption = [], ""
        else:
            rec = self.capture.get(layer, kind)
            if self.block.value and rec.tensor is not None:  # two views, one above the other
                self.figure.clear()
                self.figure.set_size_inches(*_SIZES["blocks"])
                grid = self.figure.add_gridspec(2, 1, hspace=0.6)
                self.ax = self.figure.add_subplot(grid[0])
                plot_blocks(rec.tensor, self.block.value,
                            axes=(self.ax, self.figure.add_subplot(grid[1])))
            else:
                self.figure.set_size_inches(*_SIZES["histogram"])
                plot_tensor_histogram(rec, fmts, ax=self.ax)
            self._margins()
            covs = [(None, rec.coverage(f)) for f in fmts] if rec.coverages else []
            caption = f"{layer} ({kind}, {rec.dtype}, shape {tuple(rec.shape)})"
        labels = [n for n, _ in covs] if covs and covs[0][0] else None  # None: by format
        self.table.value = coverage_table([c for _, c in covs], labels,
                                          caption)._repr_html_() if covs else ""
        self._show(self.figure)

    def _margins(self, left: float | None = None, top: float | None = None) -> None:
        """Margins in inches, whatever the figure's height (it grows with the rows)."""
        w, h = self.figure.get_size_inches()
        m = {**_MARGIN_IN, **({"left": left} if left else {}), **({"top": top} if top else {})}
        self.figure.subplots_adjust(left=min(m["left"] / w, 0.6), right=1 - m["right"] / w,
                                    bottom=m["bottom"] / h, top=1 - m["top"] / h)
