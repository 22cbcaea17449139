"""PrecisionPanel: flip mode, device and TF32 on a model while it trains, and watch the loss."""

from __future__ import annotations

import html
import time
from collections.abc import Callable
from typing import Any

import ipywidgets as widgets

from ampnb.device import devices, tf32_effect
from ampnb.display import dtype_name, format_bytes
from ampnb.fp16_kernels import FP16_KERNELS_ALLOWED
from ampnb.modes import MODES
from ampnb.panels.base import Panel, positive_int
from ampnb.plots._axes import new_axes
from ampnb.plots.training import plot_loss_curve
from ampnb.workbench import Workbench
from ampnb.workbench.ops import op_summary

_REDRAW_EVERY_S = 0.5  # during Run N: often enough to look live, rarely enough to stay cheap
_FIGSIZE = (7.0, 3.0)
# Room for 6-character tick labels, the axis labels and the title at 7 x 3 inches.
_MARGINS = dict(left=0.11, right=0.985, bottom=0.15, top=0.91)


def mode_options(device: str) -> list[tuple[str, str]]:
    """(label, mode name) for the dropdown; an unavailable or emulated mode's label says why."""
    options = []
    for name, mode in MODES.items():
        found = mode.availability(device)
        if not found.ok:
            name_label = f"{name} (unavailable: {found.reason})"
        else:  # e.g. FP8 emulated on a machine without Transformer Engine
            name_label = f"{name} ({found.reason})" if found.reason else name
        options.append((name_label, name))
    return options


def module_paths(model: Any) -> tuple[str, ...]:
    """The module picker's choices: every submodule's dotted path."""
    return tuple(name for name, _ in model.named_modules() if name)


class PrecisionPanel(Panel):
    """Mode / device / TF32 controls, Step / Run N / Reset, live loss curve and measurements."""

    css = "precision"

    def __init__(self, workbench: Workbench | None = None, run_n: int = 10,
                 window: int = 10) -> None:
        if workbench is not None and not isinstance(workbench, Workbench):
            raise ValueError(f"workbench={type(workbench).__name__} is not allowed; allowed: an "
                             f"ampnb.Workbench, or None for the demo MLP.")
        positive_int("run_n", run_n)
        self.window = positive_int("window", window)
        if workbench is None:
            from ampnb.models import demo

            workbench = Workbench(*demo("mlp"))
        self.workbench = workbench
        wb, style = workbench, {"description_width": "initial"}
        self.mode = widgets.Dropdown(options=mode_options(str(wb.device)), value=wb.mode.name,
                                     description="mode", style=style)
        self.device = widgets.Dropdown(options=[d.name for d in devices()], value=str(wb.device),
                                       description="device", style=style)
        self.tf32 = widgets.ToggleButton(value=wb.tf32, description="TF32", icon="bolt",
                                         tooltip="allow TF32 tensor-core matmuls (CUDA, Ampere+)")
        self.fp16_kernels = widgets.Dropdown(
            options=FP16_KERNELS_ALLOWED, value=wb.fp16_kernels.value, description="fp16 kernels",
            style=style, tooltip="CPU: fp16 products emulated in fp32 as tensor cores do, or "
                                 "torch's native (slow) kernels; auto picks by the CPU")
        self.keep_fp32 = widgets.SelectMultiple(
            options=module_paths(wb.model), value=wb.keep_fp32, rows=4, description="keep fp32",
            style=style)
        self.buttons = {name: widgets.Button(description=name, layout={"width": "auto"})
                        for name in ("Step", "Run N", "Reset")}
        self.n = widgets.BoundedIntText(run_n, min=1, max=100_000, description="N",
                                        layout={"width": "140px"})
        self.status = widgets.HTML()
        self.ops = widgets.HTML()
        self._base_widgets()
        self.ax = new_axes(figsize=_FIGSIZE)
        self.figure = self.ax.figure
        # Fixed margins instead of constrained layout: its extra layout pass doubled every redraw.
        self.figure.set_layout_engine(None)
        self.figure.subplots_adjust(**_MARGINS)
        self._drawn: tuple[int, Any] | None = None  # (steps, last record) the figure shows
        self._syncing = False  # True while the panel itself writes widget values
        actions = {"Step": self._step, "Run N": self._run_n, "Reset": self._reset}
        for name, action in actions.items():
            self.buttons[name].on_click(lambda _b, a=action: self._safely(a))
        self.mode.observe(lambda c: self._on_change(self._set_mode, c), names="value")
        self.device.observe(lambda c: self._on_change(self._set_device, c), names="value")
        self.tf32.observe(lambda c: self._on_change(self._set_tf32, c), names="value")
        self.fp16_kernels.observe(lambda c: self._on_change(self._set_fp16_kernels, c),
                                  names="value")
        self.keep_fp32.observe(lambda c: self._on_change(self._set_keep_fp32, c), names="value")
        b = self.buttons
        self.widget = widgets.VBox([
            widgets.HBox([self.mode, self.device, self.tf32]),
            widgets.HBox([self.fp16_kernels, self.keep_fp32]),
            widgets.HBox([b["Step"], b["Run N"], self.n, b["Reset"]]),
            self.message,
            widgets.HBox([self.out, widgets.VBox([self.status, self.ops])]),
        ])
        self._classes({"panel": self.widget, "mode": self.mode, "plot": self.out})
        self._safely(lambda: (self._trace(), "ready: press Step or Run N")[1])

    # ----- actions (each refreshes the view; errors are shown, never swallowed) ------------

    def _recover(self) -> None:
        self._sync_widgets()  # the controls show what the Workbench kept after a refusal
        self._refresh(None)

    def _on_change(self, setter: Callable[[Any], str | None], change: dict[str, Any]) -> None:
        if not self._syncing:
            self._safely(lambda: setter(change["new"]))

    def _set_mode(self, name: str) -> str:
        notes = self.workbench.set(mode=name)
        self._trace()
        return " ".join(notes) or f"switched to {name}"

    def _set_device(self, name: str) -> str:
        notes = self.workbench.set(device=name)
        self._sync_widgets()
        self._trace()
        return " ".join(notes) or f"moved to {name}"

    def _set_tf32(self, enabled: bool) -> str:
        self.workbench.set(tf32=enabled)
        return tf32_effect(self.workbench.device)

    def _set_fp16_kernels(self, choice: str) -> str:
        self.workbench.set(fp16_kernels=choice)
        return self.workbench.kernels_note or f"fp16 kernels: {choice} (the current mode computes no fp16)"

    def _set_keep_fp32(self, paths: tuple[str, ...]) -> str:
        notes = self.workbench.set(keep_fp32=tuple(paths))
        self._trace()
        kept = ", ".join(self.workbench.keep_fp32) or "none"
        return " ".join(notes) or f"modules kept in fp32: {kept}"

    def _step(self) -> str:
        r = self.workbench.step()
        return f"step {r.step}: loss {r.loss:.5g}" + (" (skipped by GradScaler)" if r.skipped else "")

    def _run_n(self) -> str:
        last_draw, records = time.perf_counter(), []
        for _ in range(int(self.n.value)):
            records.append(self.workbench.step())
            if time.perf_counter() - last_draw > _REDRAW_EVERY_S:
                self._refresh(f"running: {len(records)}/{self.n.value}")
                last_draw = time.perf_counter()
        skipped = sum(r.skipped for r in records)
        return f"ran {len(records)} steps" + (f"; {skipped} skipped by GradScaler" if skipped else "")

    def _reset(self) -> str:
        self.workbench.restore()
        self._sync_widgets()
        self._trace()
        return "reset to the weights, optimizer state and settings the Workbench started with"

    def _trace(self) -> None:
        self.ops.value = op_summary(self.workbench)._repr_html_()

    # ----- view -------------------------------------------------------------------------

    def _sync_widgets(self) -> None:
        """Make the controls show the Workbench's actual settings (after a refusal or reset)."""
        wb = self.workbench
        self._syncing = True
        try:
            self.mode.options = mode_options(str(wb.device))
            self.mode.value, self.device.value = wb.mode.name, str(wb.device)
            self.tf32.value = wb.tf32
            self.fp16_kernels.value = wb.fp16_kernels.value
            self.keep_fp32.value = wb.keep_fp32
        finally:
            self._syncing = False

    def _refresh(self, note: str | None) -> None:
        wb = self.workbench
        last = wb.history[-1] if wb.history else None
        ratio = wb.speedup(self.window)
        fields = [
            f"mode {wb.mode.name} on {wb.device}, TF32 {'on' if wb.tf32 else 'off'}",
            f"parameters {dtype_name(wb.param_dtype)}",
            f"steps {len(wb.history)}" + (f", last loss {last.loss:.5g}" if last else ""),
            f"step time {last.seconds * 1e3:.1f} ms" if last else "step time n/a",
            "speedup vs 32-true " + ("n/a (needs steps in both)" if ratio is None
                                     else f"{ratio:.2f}x (medians of recent steps)"),
            "saved for backward " + (format_bytes(last.memory) if last else "n/a"),
        ]
        if wb.kernels_note:
            fields.append(wb.kernels_note)
        if wb.keep_fp32:
            fields.append(f"kept in fp32: {', '.join(wb.keep_fp32)}")
        if last and last.nonfinite:
            fields.append(f"inf/NaN weights after step {last.step}: {', '.join(last.nonfinite[:3])}"
                          + (" ..." if len(last.nonfinite) > 3 else ""))
        if last and last.cuda_peak is not None:
            fields.append(f"CUDA peak {format_bytes(last.cuda_peak)}")
        if wb.scaler is not None:
            fields.append(f"loss scale {wb.scaler.get_scale():g}")
        body = "<br>".join(html.escape(f) for f in fields)
        if note:
            body += f"<br><i>{html.escape(note)}</i>"
        self.status.value = f'<div class="ampnb-precision-status">{body}</div>'
        shown = (len(wb.history), last)
        if self._drawn is None or shown[0] != self._drawn[0] or shown[1] is not self._drawn[1]:
            self._draw()  # a switch alone leaves the curve as it is: no costly re-render
            self._drawn = shown

    def _draw(self) -> None:
        self.ax.clear()  # reusing the Axes is cheaper than a new one on every redraw
        plot_loss_curve(self.workbench, ax=self.ax)
        self._show(self.figure)
