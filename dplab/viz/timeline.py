"""The DDP step as a picture: per rank a compute lane and a comm lane, on one time axis.

Measured steps (host clock, CUDA events) and simulated ones draw the same way, because both are
:class:`~dplab.trace.StepTrace`. What the figure shows, per rank:

- the **compute lane**: forward, backward (one span per micro-batch), the wait at the end of
  backward for outstanding all-reduces, the optimizer step;
- the **comm lane**: each bucket's all-reduce, labelled ``b0``, ``b1``, …; hover gives the
  bucket, its bytes, its parameters and its times. A sharded step (§9b) also has all-gathers,
  reduce-scatters and broadcasts, each kind in its own colour and labelled by its unit. A
  collective can run while another one is still going (gloo runs them on two threads), so
  overlapping spans go to sub-rows of the lane;
- the **exposed** part of every collective (no forward or backward compute runs then) in its
  own colour: this is the time the step pays for communication;
- **bucket-ready markers** between the lanes: the moment a bucket's last gradient arrived;
- the **prediction** ``max(T_compute, T_comm)``, a dashed line: the step with perfect overlap.
  A real step can only be slower (it is a lower bound, both terms being parts of the step).

Several steps (e.g. naive, per-parameter and bucketed) go into panels, stacked on one time axis
so that their lengths compare at a glance.

The figure is made in three steps, one module each: :mod:`~dplab.viz.timeline_panels` reads the
input into panels and lays each rank's collectives on sub-rows, :mod:`~dplab.viz.timeline_marks`
gathers a panel's marks rank by rank as plain data, and this module turns them into plotly
traces on one figure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dplab.trace import StepTrace
from dplab.trace.metrics import COMM_KINDS
from dplab.viz.style import COLORS, layout
from dplab.viz.timeline_marks import (
    BAR_WIDTH,
    COMPUTE_KINDS,
    MAX_PARAMS_IN_HOVER,
    Bars,
    panel_marks,
)
from dplab.viz.timeline_panels import (
    COLLECTIVE_NAMES,
    comm_rows,
    comm_spans,
    describe_step,
    panels_of,
    summary_line,
)

__all__ = [  # the figure, and the names this module had before its parts moved out
    "ALIGNS",
    "BAR_WIDTH",
    "COLLECTIVE_NAMES",
    "COMPUTE_KINDS",
    "KIND_LABELS",
    "MAX_PARAMS_IN_HOVER",
    "ROW_PX",
    "SHARDED_LABELS",
    "comm_rows",
    "comm_spans",
    "describe_step",
    "panels_of",
    "summary_line",
    "timeline_figure",
]

ALIGNS = ("rank0", "step")
KIND_LABELS = {
    "forward": "forward",
    "backward": "backward",
    "wait": "wait for all-reduces",
    "optimizer": "optimizer",
    "allreduce": "all-reduce (hidden under backward)",
    "allgather": "all-gather (hidden under compute)",
    "reduce_scatter": "reduce-scatter (hidden under compute)",
    "broadcast": "broadcast (hidden under compute)",
    "exposed": "all-reduce, exposed",
    "bucket_ready": "bucket ready",
    "predicted": "max(T_compute, T_comm)",
}
# a figure holding a sharded step (§9b) waits for, and exposes, more than all-reduces
SHARDED_LABELS = {"wait": "waiting for communication", "exposed": "communication, exposed"}
ROW_PX = 34


def _labels(panels: Sequence[Sequence[StepTrace]]) -> dict[str, str]:
    """The legend's names: DDP's, or the general ones when any step has another collective."""
    sharded = any(s.kind in COMM_KINDS[1:] for p in panels for t in p for s in t.spans)
    return {**KIND_LABELS, **SHARDED_LABELS} if sharded else KIND_LABELS


def _add_bars(
    fig: go.Figure,
    bars: dict[str, Bars],
    where: dict[str, int],
    legend_seen: set[str],
    labels: Mapping[str, str],
) -> None:
    """One horizontal bar trace per kind (compute kinds, all-reduce, exposed)."""
    colors = {**COLORS}
    for kind, group in bars.items():
        if not group.x and kind != "allreduce":
            continue
        fig.add_trace(
            go.Bar(
                orientation="h",
                base=group.base,
                x=group.x,
                y=group.y,
                width=BAR_WIDTH,
                text=group.text,
                textposition="inside",
                insidetextanchor="middle",
                textangle=0,
                hovertext=group.hover,
                hoverinfo="text",
                marker={"color": colors[kind], "line": {"width": 0.5, "color": "white"}},
                name=labels[kind],
                legendgroup=kind,
                showlegend=kind not in legend_seen and bool(group.x),
            ),
            **where,
        )
        if group.x:
            legend_seen.add(kind)


def _add_ready_marks(
    fig: go.Figure,
    ready: tuple[list[float], list[float], list[str]],
    where: dict[str, int],
    legend_seen: set[str],
) -> None:
    """A triangle where each bucket became ready."""
    ready_x, ready_y, ready_hover = ready
    if ready_x:
        fig.add_trace(
            go.Scatter(
                x=ready_x,
                y=ready_y,
                mode="markers",
                marker={"symbol": "triangle-down", "size": 9, "color": COLORS["bucket_ready"]},
                hovertext=ready_hover,
                hoverinfo="text",
                name=KIND_LABELS["bucket_ready"],
                legendgroup="bucket_ready",
                showlegend="bucket_ready" not in legend_seen,
            ),
            **where,
        )
        legend_seen.add("bucket_ready")


def _add_predicted(
    fig: go.Figure,
    predicted: list[tuple[float, float, float, str]],
    where: dict[str, int],
    legend_seen: set[str],
) -> None:
    """A dashed line per rank at max(T_compute, T_comm): the step with perfect overlap."""
    xs: list[float | None] = []
    ys: list[float | None] = []
    hovers: list[str | None] = []
    for x, top, bottom, hover in predicted:
        xs += [x, x, x, None]
        ys += [top, (top + bottom) / 2, bottom, None]
        hovers += [hover, hover, hover, None]
    fig.add_trace(
        go.Scatter(
            x=xs,
            y=ys,
            mode="lines+markers",
            line={"color": COLORS["predicted"], "dash": "dash", "width": 2},
            marker={"size": 3, "color": COLORS["predicted"]},
            hovertext=hovers,
            hoverinfo="text",
            name=KIND_LABELS["predicted"],
            legendgroup="predicted",
            showlegend="predicted" not in legend_seen,
        ),
        **where,
    )
    legend_seen.add("predicted")


def _draw_panel(
    fig: go.Figure,
    panel: Sequence[StepTrace],
    *,
    align: str,
    where: dict[str, int],
    legend_seen: set[str],
    show_predicted: bool,
    labels: Mapping[str, str],
) -> tuple[list[float], list[str]]:
    """Add one panel's traces to ``fig`` (its marks, :func:`panel_marks`); return its y tick
    positions and labels."""
    marks = panel_marks(panel, align=align)
    _add_bars(fig, marks.bars, where, legend_seen, labels)
    _add_ready_marks(fig, (marks.ready_x, marks.ready_y, marks.ready_hover), where, legend_seen)
    if show_predicted:
        _add_predicted(fig, marks.predicted, where, legend_seen)
    return marks.tickvals, marks.ticktext


def _lanes(panel: Sequence[StepTrace]) -> float:
    return sum(2 + max(comm_rows(t), default=0) + 0.6 for t in panel)


def _subplots(
    panels: list[list[StepTrace]],
    titles: list[str],
    *,
    arrange: str,
    shared_time: bool,
    height: int | None,
) -> tuple[go.Figure, list[dict[str, int]], int]:
    """The empty figure: one subplot per panel, sized by its lanes; its cells and height."""
    lanes = [_lanes(p) for p in panels]
    n = len(panels)
    gap_px = 95  # between stacked panels: the time axis' labels, then the next panel's title
    if height is None:
        per_panel = ROW_PX * (sum(lanes) if arrange == "stack" else max(lanes))
        height = int(max(300, per_panel + gap_px * (n - 1 if arrange == "stack" else 0) + 220))
    plot_px = max(height - 220, 1)  # the margins and legend take the rest
    if arrange == "stack":
        fig = make_subplots(
            rows=n,
            cols=1,
            shared_xaxes=shared_time,
            row_heights=[x / sum(lanes) for x in lanes],
            subplot_titles=titles,
            vertical_spacing=min(gap_px / plot_px, 0.5 / n) if n > 1 else 0.0,
        )
        cells = [{"row": i + 1, "col": 1} for i in range(n)]
    else:
        fig = make_subplots(
            rows=1,
            cols=n,
            shared_xaxes=shared_time,
            subplot_titles=titles,
            horizontal_spacing=min(0.08, 0.4 / n) if n > 1 else 0.0,
        )
        cells = [{"row": 1, "col": i + 1} for i in range(n)]
    return fig, cells, height


def timeline_figure(
    traces: Any,
    *,
    title: str | None = None,
    align: str = "rank0",
    panel_titles: Sequence[str] | None = None,
    arrange: str = "stack",
    shared_time: bool = True,
    show_predicted: bool = True,
    height: int | None = None,
) -> go.Figure:
    """A timeline of one or several DDP steps.

    Args:
        traces: a StepTrace; a list of StepTrace (one step, one trace per rank); or a list of
            those lists (one panel each, e.g. naive / per-parameter / bucketed).
        title: the figure's title (default: the first panel's description).
        align: ``"rank0"`` puts every rank on rank 0's clock (a late rank shows as a shift);
            ``"step"`` starts every rank's step at 0.
        panel_titles: one title per panel (default: what ran, and its numbers).
        arrange: ``"stack"`` (panels one above the other) or ``"side"`` (side by side).
        shared_time: one time axis for all panels, so lengths compare directly.
        show_predicted: draw the ``max(T_compute, T_comm)`` line.
        height: pixels (default: from the number of lanes).
    """
    if align not in ALIGNS:
        raise ValueError(f"align must be one of {ALIGNS}, got {align!r}")
    if arrange not in ("stack", "side"):
        raise ValueError(f"arrange must be 'stack' or 'side', got {arrange!r}")
    panels = panels_of(traces)
    if panel_titles is not None and len(panel_titles) != len(panels):
        raise ValueError(f"{len(panel_titles)} panel titles for {len(panels)} panels")
    titles = (
        list(panel_titles)
        if panel_titles is not None
        else [f"{describe_step(p[0])}<br><sup>{summary_line(p)}</sup>" for p in panels]
    )
    fig, cells, height = _subplots(
        panels, titles, arrange=arrange, shared_time=shared_time, height=height
    )
    n = len(panels)
    legend_seen: set[str] = set()
    labels = _labels(panels)
    for panel, where in zip(panels, cells, strict=True):
        tickvals, ticktext = _draw_panel(
            fig,
            panel,
            align=align,
            where=where,
            legend_seen=legend_seen,
            show_predicted=show_predicted,
            labels=labels,
        )
        fig.update_yaxes(
            tickvals=tickvals,
            ticktext=ticktext,
            autorange="reversed",
            zeroline=False,
            showgrid=False,
            **where,
        )
    clock = "rank 0's step start" if align == "rank0" else "each rank's step start"
    fig.update_xaxes(title_text=f"ms from {clock}", zeroline=False)
    if arrange == "stack" and shared_time and n > 1:
        for i in range(1, n):
            fig.update_xaxes(title_text="", showticklabels=True, row=i, col=1)
    fig.update_layout(barmode="overlay", bargap=0, uniformtext={"minsize": 9, "mode": "hide"})
    layout(
        fig,
        title=title or ("DDP step timeline" if n > 1 else describe_step(panels[0][0])),
        height=height,
    )
    fig.update_layout(
        margin={"t": 90 if n == 1 else 110, "b": 120},
        hoverlabel={"align": "left"},
        # Below the time axis whatever the figure's height (a fraction of the plot would not be).
        legend={"orientation": "h", "yref": "container", "y": 0.0, "yanchor": "bottom", "x": 0},
    )
    if n == 1 and panel_titles is None:
        # One panel: its description is the title already; keep only the numbers above it.
        fig.layout.annotations[0].text = f"<sup>{summary_line(panels[0])}</sup>"
    return fig
