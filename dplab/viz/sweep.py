"""The bucket-size sweep: step time and exposed communication against the bucket cap.

The U-curve of DDP. Left of the bottom, buckets are small: many all-reduces, each paying the
collective's latency (and on a CPU box, each waking gloo's threads while backward computes).
Right of it, buckets are big: the first one is ready late, so little communication can hide
under backward and the last bucket's all-reduce sits exposed after it. Measured repeats are drawn
as points with their median joined; the simulator's prediction is a line.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dplab.trace.sweep import best_cap, by_cap
from dplab.viz.style import COLORS, layout

METRICS = (
    ("t_step_ms", "step time (ms)"),
    ("exposed_comm_ms", "exposed comm (ms)"),
)
SIMULATED_COLOR = "#B279A2"


def _check_rows(rows: Iterable[Mapping[str, Any]], what: str) -> list[Mapping[str, Any]]:
    rows = list(rows)
    for r in rows:
        for key in ("bucket_cap_mb", *(k for k, _ in METRICS)):
            if key not in r:
                raise ValueError(f"a {what} row has no {key!r}: {dict(r)!r}")
        cap = r["bucket_cap_mb"]
        if not isinstance(cap, (int, float)) or not cap > 0:
            raise ValueError(f"a {what} row has a bad bucket_cap_mb {cap!r}")
    return rows


def _add_measured(fig: go.Figure, rows: list[Mapping[str, Any]], key: str, label: str, row: int):
    """Every measured step as a point, and the median per cap as a line."""
    fig.add_trace(
        go.Scatter(
            x=[float(r["bucket_cap_mb"]) for r in rows],
            y=[float(r[key]) for r in rows],
            mode="markers",
            marker={"color": COLORS["allreduce"], "size": 6, "opacity": 0.45},
            name="measured (each step, each rank)",
            legendgroup="measured",
            showlegend=row == 1,
            hovertemplate=f"cap %{{x:g}} MiB<br>{label}: %{{y:.2f}}<extra>measured</extra>",
        ),
        row=row,
        col=1,
    )
    medians = by_cap(rows, key)
    fig.add_trace(
        go.Scatter(
            x=[m[0] for m in medians],
            y=[m[1] for m in medians],
            mode="lines+markers",
            line={"color": COLORS["allreduce"], "width": 2},
            marker={"size": 8},
            name="measured median",
            legendgroup="median",
            showlegend=row == 1,
            customdata=[m[2] for m in medians],
            hovertemplate=f"cap %{{x:g}} MiB, %{{customdata}} buckets<br>median {label}:"
            " %{y:.2f}<extra>measured</extra>",
        ),
        row=row,
        col=1,
    )


def _add_simulated(fig: go.Figure, rows: list[Mapping[str, Any]], key: str, label: str, row: int):
    """The simulator's prediction per cap, as a dashed line."""
    sims = by_cap(rows, key)
    fig.add_trace(
        go.Scatter(
            x=[m[0] for m in sims],
            y=[m[1] for m in sims],
            mode="lines",
            line={"color": SIMULATED_COLOR, "width": 2, "dash": "dash"},
            name="simulated",
            legendgroup="simulated",
            showlegend=row == 1,
            customdata=[m[2] for m in sims],
            hovertemplate=f"cap %{{x:g}} MiB, %{{customdata}} buckets<br>{label}:"
            " %{y:.2f}<extra>simulated</extra>",
        ),
        row=row,
        col=1,
    )


def _add_marks(
    fig: go.Figure,
    marks: list[tuple[float, str, str, str]],
    rows: list[Mapping[str, Any]],
) -> None:
    """Vertical lines at chosen caps (the fastest measured, the current one) in both panels."""
    for row, (key, _) in enumerate(METRICS, start=1):
        top = max(float(r[key]) for r in rows) * 1.05 or 1.0
        for cap, label, color, dash in marks:
            # A trace, not add_vline: shapes on a log axis take log10(x), which is easy to get
            # wrong and stretches the axis when it is.
            fig.add_trace(
                go.Scatter(
                    x=[cap, cap],
                    y=[0, top],
                    mode="lines",
                    line={"color": color, "dash": dash, "width": 1.5},
                    name=f"{label}: {cap:g} MiB",
                    legendgroup=label,
                    showlegend=row == 1,
                    hovertemplate=f"{label}: {cap:g} MiB<extra></extra>",
                ),
                row=row,
                col=1,
            )


def sweep_figure(
    measured_rows: Iterable[Mapping[str, Any]],
    simulated_rows: Iterable[Mapping[str, Any]] | None = None,
    *,
    title: str | None = None,
    current_cap: float | None = None,
    height: int = 560,
) -> go.Figure:
    """Step time (top) and exposed comm (bottom) against the bucket cap, log scale.

    Rows are mappings with ``bucket_cap_mb``, ``t_step_ms`` and ``exposed_comm_ms`` (and
    optionally ``n_buckets``), e.g. from :func:`dplab.trace.sweep_row`. Several rows per cap
    (repeats, ranks) are points; their median is the line. ``current_cap`` draws a marker at
    that cap.
    """
    measured = _check_rows(measured_rows, "measured")
    simulated = _check_rows(simulated_rows or [], "simulated")
    if not measured and not simulated:
        raise ValueError("no rows to plot: run the sweep first")
    fig = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.08,
        subplot_titles=[label for _, label in METRICS],
    )
    for row, (key, label) in enumerate(METRICS, start=1):
        if measured:
            _add_measured(fig, measured, key, label, row)
        if simulated:
            _add_simulated(fig, simulated, key, label, row)
        fig.update_yaxes(title_text="ms", rangemode="tozero", row=row, col=1)
    marks = []
    if measured:
        marks.append((best_cap(measured), "fastest measured", COLORS["optimizer"], "dot"))
    if current_cap is not None:
        marks.append((float(current_cap), "current cap", "#333333", "dash"))
    _add_marks(fig, marks, [*measured, *simulated])
    fig.update_xaxes(type="log")
    fig.update_xaxes(title_text="bucket cap (MiB, log scale)", row=2, col=1)
    layout(
        fig,
        title=title or "Bucket size: too small pays latency, too big hides nothing",
        height=height,
    )
    return fig
