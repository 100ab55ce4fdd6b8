"""Small pieces the DDP widgets share: messages, error summaries, figure swapping, caps."""

from __future__ import annotations

import html
from typing import Any

import plotly.graph_objects as go

from dplab.launch import RankError

ERROR_COLOR = "#B03A2E"
MUTED_COLOR = "#555"
# Bucket caps on the sliders (MiB): roughly 2-2.5x apart, so every step of a slider changes
# something, and torch's 25 MiB default is among them.
CAPS_MB = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0)


def cap_options(extra: float | None = None) -> list[tuple[str, float]]:
    """(label, value) pairs for a SelectionSlider over :data:`CAPS_MB` (plus ``extra``)."""
    caps = sorted(set(CAPS_MB) | ({float(extra)} if extra is not None else set()))
    return [(f"{c:g} MiB", c) for c in caps]


def error_html(text: str) -> str:
    return f"<div style='color:{ERROR_COLOR}'><b>Refused:</b> {html.escape(text)}</div>"


def failure_html(what: str, text: str) -> str:
    return f"<div style='color:{ERROR_COLOR}'><b>{html.escape(what)}:</b> {html.escape(text)}</div>"


def status_html(text: str, *, busy: bool = False) -> str:
    mark = "⏳ " if busy else ""
    return f"<span style='color:{MUTED_COLOR}'>{mark}{html.escape(text)}</span>"


def short_error(e: BaseException) -> str:
    """One line a learner can act on: for a failed rank, its rank and its last error line."""
    if isinstance(e, RankError):
        lines = [line for line in e.traceback.strip().splitlines() if line.strip()]
        return f"rank {e.rank} failed: {lines[-1].strip() if lines else 'no traceback'}"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


FIGURE_WIDTH_PX = 960  # a FigureWidget does not follow its container's width: give it one


def show_figure(widget: go.FigureWidget, fig: go.Figure, *, width: int = FIGURE_WIDTH_PX) -> None:
    """Replace what a FigureWidget shows by ``fig``, in one update of the front end."""
    fig.update_layout(width=width)
    with widget.batch_update():
        widget.data = ()
        widget.add_traces(list(fig.data))
        widget.layout = fig.layout


def placeholder_figure(text: str, *, height: int = 160) -> go.Figure:
    """An empty figure that says what will appear in it (instead of bare axes)."""
    fig = go.Figure()
    fig.add_annotation(text=text, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_layout(
        template="plotly_white",
        height=height,
        xaxis={"visible": False},
        yaxis={"visible": False},
        margin={"l": 10, "r": 10, "t": 10, "b": 10},
    )
    return fig


def classed(widget: Any, *classes: str) -> Any:
    """Give ``widget`` stable CSS classes (for browser tests and styling); return it."""
    for c in classes:
        widget.add_class(c)
    return widget
