"""ScalerPanel: buttons that walk a ScalerStepper stage by stage, with the scale plotted live."""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import Any

import ipywidgets as widgets

from ampnb.panels.base import Panel, positive_int
from ampnb.plots._axes import new_axes
from ampnb.plots.scale import plot_scale_history, plot_step_gradients
from ampnb.scaler import ScalerStepper, diagnose, explain_error
from ampnb.scaler.records import format_scale

_HIGHLIGHT = "background:#ffe58a;font-weight:bold"

# control name -> (widget factory, how to read it into a stepper setting)
_CONTROLS: dict[str, tuple[Callable[[Any], widgets.Widget], Callable[[Any], Any]]] = {
    "init_scale": (lambda v: widgets.FloatText(v, description="init_scale"), float),
    "growth_factor": (lambda v: widgets.FloatText(v, description="growth_factor"), float),
    "backoff_factor": (lambda v: widgets.FloatText(v, description="backoff_factor"), float),
    "growth_interval": (lambda v: widgets.IntText(v, description="growth_interval"), int),
    "accumulation_steps": (lambda v: widgets.IntText(v, description="accumulation"), int),
    "clip_norm": (lambda v: widgets.FloatText(v or 0.0, description="clip_norm (0=off)"),
                  lambda v: float(v) or None),
}


# plot name -> what draws it from the stepper (the figure below the loop)
_VIEWS = {"scale history": plot_scale_history, "gradients vs fp16": plot_step_gradients}


class ScalerPanel(Panel):
    """Next stage / Next step / Run N / Inject inf / Inject NaN / Reset, and the loop's state."""

    css = "scaler"

    def __init__(self, stepper: ScalerStepper, run_n: int = 10) -> None:
        if not isinstance(stepper, ScalerStepper):
            raise ValueError(f"stepper={type(stepper).__name__} is not allowed; allowed: an "
                             f"ampnb.ScalerStepper (a Workbench goes to PrecisionPanel).")
        positive_int("run_n", run_n)
        self.stepper = stepper
        style = {"description_width": "initial"}
        self.buttons = {name: widgets.Button(description=name, layout={"width": "auto"})
                        for name in ("Next stage", "Next step", "Run N", "Inject inf",
                                     "Inject NaN", "Reset")}
        self.n = widgets.BoundedIntText(run_n, min=1, max=10_000, description="N",
                                        layout={"width": "140px"})
        self.layer = widgets.Dropdown(options=["all", *stepper.layers], value="all",
                                      description="inject into", style=style)
        s = stepper.settings
        self.controls = {name: make(getattr(s, name)) for name, (make, _) in _CONTROLS.items()}
        for w in self.controls.values():
            w.style = style
            w.layout = {"width": "220px"}
            w.observe(self._on_control, names="value")
        self.listing = widgets.HTML(layout={"min_width": "600px"})
        self.status = widgets.HTML()
        self._base_widgets()
        self.guidance = widgets.HTML()  # what this run shows: no scaler needed, collapse...
        self.view = widgets.ToggleButtons(options=list(_VIEWS), value="scale history",
                                          description="plot", style=style)
        self.view.observe(lambda _c: self._safely(lambda: f"showing {self.view.value}"),
                          names="value")
        self.ax = new_axes(figsize=(7.0, 3.2))
        self.figure = self.ax.figure
        actions = {"Next stage": self._next_stage, "Next step": self._next_step,
                   "Run N": self._run_n, "Inject inf": lambda: self._inject("inf"),
                   "Inject NaN": lambda: self._inject("nan"), "Reset": self._reset}
        for name, action in actions.items():
            self.buttons[name].on_click(lambda _b, a=action: self._safely(a))
        b = self.buttons
        self.widget = widgets.VBox([
            widgets.HBox([b["Next stage"], b["Next step"], b["Run N"], self.n]),
            widgets.HBox([b["Inject inf"], b["Inject NaN"], self.layer, b["Reset"]]),
            widgets.HBox(list(self.controls.values())[:3]),
            widgets.HBox(list(self.controls.values())[3:]),
            widgets.HBox([self.listing, widgets.VBox([self.status, self.message])]),
            self.guidance,
            self.view,
            self.out,
        ])
        self._classes({"panel": self.widget, "plot": self.out})
        self._safely(lambda: "ready: press Next stage")

    # ----- actions (each refreshes the view; errors are shown, never swallowed) ------------

    def _next_stage(self) -> str:
        return self.stepper.next_stage().summary()

    def _next_step(self) -> str:
        self.stepper.step()
        return self.stepper.stages[-1].summary()

    def _run_n(self) -> str:
        records = self.stepper.run(int(self.n.value))
        return f"ran {len(records)} steps; {sum(r.skipped for r in records)} skipped"

    def _inject(self, kind: str) -> str:
        layer = None if self.layer.value == "all" else self.layer.value
        self.stepper.inject(kind, layer)
        return f"armed: the next micro-step's gradients become {kind} in {layer or 'all layers'}"

    def _reset(self) -> str:
        self.stepper.reset(**self._settings())
        return "reset to the initial model and optimizer state"

    def _on_control(self, _change: Any) -> None:
        self._safely(lambda: (self.stepper.reset(**self._settings()),
                              "settings changed: rebuilt from the initial state")[1])

    def _settings(self) -> dict[str, Any]:
        return {name: read(self.controls[name].value) for name, (_, read) in _CONTROLS.items()}

    def _error_detail(self, err: Exception) -> str:
        guidance = explain_error(err)  # what the error means for this loop, where ampnb knows
        return guidance._repr_html_() if guidance is not None else super()._error_detail(err)

    # ----- view -------------------------------------------------------------------------

    def _refresh(self, note: str | None) -> None:
        s = self.stepper
        rows = []
        for stage, line in s.listing():
            mark = stage == s.next_stage_name
            css = f' style="{_HIGHLIGHT}"' if mark else ""
            rows.append(f"<span{css}>{'&#9654; ' if mark else '  '}{html.escape(line)}</span>")
        self.listing.value = ('<pre style="font-size:12px;line-height:1.35;white-space:pre;overflow-x:auto">'
                              + "\n".join(rows) + "</pre>")
        last = s.history[-1] if s.history else None
        micro = (f" (micro-step {s.micro_step + 1}/{s.settings.accumulation_steps})"
                 if s.next_stage_name in ("forward", "divide", "backward") else "")
        fields = [f"step {s.step_index}, next: {s.next_stage_name}{micro}",
                  f"scale {format_scale(s.scale)}", f"growth tracker {s.growth_tracker}",
                  f"found_inf {last.found_inf if last else '-'}",
                  f"skipped {last.skipped if last else '-'}",
                  f"steps skipped {sum(r.skipped for r in s.history)}/{len(s.history)}"]
        if not s.enabled:
            fields.append(f"scaler disabled ({s.mode.name})")
        body = "<br>".join(html.escape(f) for f in fields)
        if note:
            body += f"<br><i>{html.escape(note)}</i>"
        self.status.value = f'<div class="ampnb-scaler-status">{body}</div>'
        self.guidance.value = "".join(g._repr_html_() for g in diagnose(s))
        self._draw()

    def _draw(self) -> None:
        self.figure.clear()  # the twin axis goes too; the same figure is redrawn in place
        self.ax = self.figure.add_subplot(1, 1, 1)
        _VIEWS[self.view.value](self.stepper, ax=self.ax)
        self._show(self.figure)
