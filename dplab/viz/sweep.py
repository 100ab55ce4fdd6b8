"""The bucket-size sweep: step time and exposed communication against the bucket cap.

The U-curve of DDP. Left of the bottom, buckets are small: many all-reduces, each paying the
collective's latency (and on a CPU box, each waking gloo's threads while backward computes).
Right of it, buckets are big: the first one is ready late, so little communication can hide
under backward and the last bucket's all-reduce sits exposed after it. Measured repeats are drawn
as points with their median joined; the simulator's prediction is a line.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dplab.trace import StepTrace
from dplab.viz.style import COLORS, layout

METRICS = (
    ("t_step_ms", "step time (ms)"),
    ("exposed_comm_ms", "exposed comm (ms)"),
)
SIMULATED_COLOR = "#B279A2"


def sweep_row(trace: StepTrace, **extra: Any) -> dict[str, Any]:
    """One row of a sweep from a step: its cap (from ``trace.meta`` unless given), bucket
    count and metrics."""
    m = trace.metrics
    row = {
        "bucket_cap_mb": trace.meta.get("bucket_cap_mb"),
        "n_buckets": len(trace.buckets) or len({s.bucket for s in trace.of("allreduce")}),
        "rank": trace.rank,
        "world_size": trace.world_size,
        "t_step_ms": m.t_step_ms,
        "t_compute_ms": m.t_compute_ms,
        "t_comm_ms": m.t_comm_ms,
        "exposed_comm_ms": m.exposed_comm_ms,
        "predicted_step_ms": m.predicted_step_ms,
        "simulated": trace.simulated,
    }
    row.update(extra)
    if row["bucket_cap_mb"] is None:
        raise ValueError("the trace does not say its bucket cap: pass bucket_cap_mb=")
    return row


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


def _by_cap(rows: Sequence[Mapping[str, Any]], key: str) -> list[tuple[float, float, Any]]:
    """(cap, median of key, bucket count) per cap, caps ascending."""
    groups: dict[float, list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault(float(r["bucket_cap_mb"]), []).append(r)
    return [
        (
            cap,
            statistics.median(float(r[key]) for r in group),
            group[0].get("n_buckets"),
        )
        for cap, group in sorted(groups.items())
    ]


def best_cap(rows: Sequence[Mapping[str, Any]]) -> float:
    """The cap with the lowest median step time.

    Where neighbouring caps tie (the simulator's step only changes where the bucket plan
    does), the middle of the widest tied run, the choice least sensitive to the model.
    """
    medians = _by_cap(rows, "t_step_ms")
    if not medians:
        raise ValueError("no rows")
    best = min(m[1] for m in medians)
    runs: list[list[float]] = []
    previous_tied = False
    for cap, step, _ in medians:
        tied = step <= best * (1 + 1e-9)
        if tied:
            if previous_tied:
                runs[-1].append(cap)
            else:
                runs.append([cap])
        previous_tied = tied
    widest = max(runs, key=len)
    return widest[len(widest) // 2]


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
    optionally ``n_buckets``), e.g. from :func:`sweep_row`. Several rows per cap (repeats,
    ranks) are points; their median is the line. ``current_cap`` draws a marker at that cap.
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
        first = row == 1
        if measured:
            fig.add_trace(
                go.Scatter(
                    x=[float(r["bucket_cap_mb"]) for r in measured],
                    y=[float(r[key]) for r in measured],
                    mode="markers",
                    marker={"color": COLORS["allreduce"], "size": 6, "opacity": 0.45},
                    name="measured (each step, each rank)",
                    legendgroup="measured",
                    showlegend=first,
                    hovertemplate=f"cap %{{x:g}} MiB<br>{label}: %{{y:.2f}}<extra>measured</extra>",
                ),
                row=row,
                col=1,
            )
            medians = _by_cap(measured, key)
            fig.add_trace(
                go.Scatter(
                    x=[m[0] for m in medians],
                    y=[m[1] for m in medians],
                    mode="lines+markers",
                    line={"color": COLORS["allreduce"], "width": 2},
                    marker={"size": 8},
                    name="measured median",
                    legendgroup="median",
                    showlegend=first,
                    customdata=[m[2] for m in medians],
                    hovertemplate=f"cap %{{x:g}} MiB, %{{customdata}} buckets<br>median {label}:"
                    " %{y:.2f}<extra>measured</extra>",
                ),
                row=row,
                col=1,
            )
        if simulated:
            sims = _by_cap(simulated, key)
            fig.add_trace(
                go.Scatter(
                    x=[m[0] for m in sims],
                    y=[m[1] for m in sims],
                    mode="lines",
                    line={"color": SIMULATED_COLOR, "width": 2, "dash": "dash"},
                    name="simulated",
                    legendgroup="simulated",
                    showlegend=first,
                    customdata=[m[2] for m in sims],
                    hovertemplate=f"cap %{{x:g}} MiB, %{{customdata}} buckets<br>{label}:"
                    " %{y:.2f}<extra>simulated</extra>",
                ),
                row=row,
                col=1,
            )
        fig.update_yaxes(title_text="ms", rangemode="tozero", row=row, col=1)
    marks = []
    if measured:
        marks.append((best_cap(measured), "fastest measured", COLORS["optimizer"], "dot"))
    if current_cap is not None:
        marks.append((float(current_cap), "current cap", "#333333", "dash"))
    for row, (key, _) in enumerate(METRICS, start=1):
        top = max(float(r[key]) for r in [*measured, *simulated]) * 1.05 or 1.0
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
    fig.update_xaxes(type="log")
    fig.update_xaxes(title_text="bucket cap (MiB, log scale)", row=2, col=1)
    layout(
        fig,
        title=title or "Bucket size: too small pays latency, too big hides nothing",
        height=height,
    )
    return fig
