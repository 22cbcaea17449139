"""The one panel base: an error box, safe callbacks, warnings shown, redraws in an Output."""

from __future__ import annotations

import html
import traceback
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import ipywidgets as widgets
from IPython.display import clear_output, display


def positive_int(name: str, value: Any) -> int:
    """value as an int >= 1, else a one-line ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is not allowed; allowed: an integer >= 1.")
    return value


class Panel:
    """Base of ampnb's panels; a subclass sets `css` and writes `_refresh(note)`.

    Every action runs through `_safely`: its warnings are shown in the panel, an exception is
    shown in an error box (class `ampnb-error` and `ampnb-<css>-error`), never swallowed, and
    the view is refreshed either way.
    """

    css: ClassVar[str] = "panel"  # the `ampnb-<css>-<part>` prefix of this panel's CSS classes
    widget: widgets.Widget

    def _base_widgets(self) -> None:
        self.message = widgets.HTML()
        self.out = widgets.Output()
        self.draws = 0

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    def _classes(self, parts: dict[str, widgets.Widget]) -> None:
        """Stable hooks for the browser tests (tests/browser) and for users' own CSS."""
        for part, w in parts.items():
            w.add_class(f"ampnb-{self.css}-{part}")

    # ----- actions ------------------------------------------------------------------------

    def _safely(self, action: Callable[[], str | None]) -> None:
        """Run a control's action; show its note, its warnings or its error in the panel."""
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")  # they would land outside the panel
                note = action() or ""
            said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
            # A warning the note already says (a Workbench switch's notes) is said once.
            shown = " ".join(dict.fromkeys([note, *(m for m in said if m not in note)])).strip()
            self.message.value = ""
            self._refresh(shown or None)
        except Exception as err:  # noqa: BLE001 - shown to the learner in the panel
            self.message.value = self._error_box(err)
            try:
                self._recover()
            except Exception as again:  # noqa: BLE001 - shown too, after the first
                self.message.value += f"<pre>{html.escape(f'{type(again).__name__}: {again}')}</pre>"

    def _recover(self) -> None:
        """After an error: show the state as it is now (subclasses re-sync their controls)."""
        self._refresh(None)

    def _refresh(self, note: str | None) -> None:
        raise NotImplementedError

    def _error_detail(self, err: Exception) -> str:
        """HTML under the error line: the traceback, folded."""
        return (f"<details><summary>traceback</summary><pre>{html.escape(traceback.format_exc())}"
                f"</pre></details>")

    def _error_box(self, err: Exception) -> str:
        text = html.escape(f"{type(err).__name__}: {err}")
        return (f'<div class="ampnb-error ampnb-{self.css}-error" style="color:#b00">'
                f"<b>{text}</b>{self._error_detail(err)}</div>")

    # ----- view ---------------------------------------------------------------------------

    def _show(self, figure: Any) -> None:
        """Redraw the figure in the panel's Output, replacing the last one without a flicker."""
        self.draws += 1
        with self.out:
            clear_output(wait=True)
            display(figure)
