"""Make a Figure/Axes without pyplot, so no global state or backend is touched."""

from __future__ import annotations

import io

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


class NotebookFigure(Figure):
    """A pyplot-free Figure that Jupyter shows as a PNG (IPython calls `_repr_png_`)."""

    def _repr_png_(self) -> bytes:
        buf = io.BytesIO()
        self.savefig(buf, format="png", dpi=96)
        return buf.getvalue()


def new_axes(ax: Axes | None = None, figsize: tuple[float, float] = (7.0, 3.0),
             nrows: int = 1, ncols: int = 1) -> Axes:
    """Return ax, or a fresh Axes on a pyplot-free Figure; show it with `ax.figure`."""
    if ax is not None:
        return ax
    fig = NotebookFigure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)
    return fig.add_subplot(nrows, ncols, 1)
