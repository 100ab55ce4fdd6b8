"""Figures for all-reduce: measured bandwidth with its α-β fit, the ring step by step, and naive
versus ring.

Nothing here measures or runs ranks: the bandwidth plot takes rows the bench measured, and the
ring figure takes the pure schedule (:func:`dplab.collectives.ring_schedule`), which the tests
check against what real ranks sent.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dplab._checks import check_count, check_world_size
from dplab._units import format_size
from dplab.collectives import (
    REDUCE_SCATTER,
    AlphaBetaFit,
    BandwidthRow,
    chunk_bounds,
    ring_partial_sums,
    ring_phase,
    ring_schedule,
    ring_steps,
)
from dplab.viz.style import COLORS, layout

ALGORITHM_COLORS = {
    "all_reduce": COLORS["allreduce"],
    "ring": COLORS["forward"],
    "naive": "#B279A2",
}
ALGORITHM_NAMES = {"all_reduce": "dist.all_reduce", "ring": "ring (send/recv)", "naive": "naive"}


def _as_row(row: Any) -> BandwidthRow:
    return row if isinstance(row, BandwidthRow) else BandwidthRow(**row)


def _size_ticks(sizes: Sequence[int]) -> dict[str, Any]:
    return {"tickvals": list(sizes), "ticktext": [format_size(s) for s in sizes]}


def _series_by_algorithm(rows: Sequence[BandwidthRow]) -> list[tuple[str, int, list[BandwidthRow]]]:
    """The rows cut into one series per (algorithm, world size), each sorted by message size.

    Each series is one line on both panels: busbw's factor 2(N-1)/N depends on N, so
    points of different N or algorithm on one line would mix two different curves.
    """
    groups: dict[tuple[str, int], list[BandwidthRow]] = {}
    for r in rows:
        groups.setdefault((r.algorithm, r.world_size), []).append(r)
    return [
        (algorithm, n, sorted(group, key=lambda r: r.size_bytes))
        for (algorithm, n), group in sorted(groups.items())
    ]


def _add_measured_series(
    fig: go.Figure, series: list[BandwidthRow], name: str, color: str, dash: str
) -> None:
    """The measured rows twice: time on the left, busbw on the right, one legend entry."""
    sizes = [r.size_bytes for r in series]
    hover = [
        f"{format_size(r.size_bytes)}: {r.time_s * 1e6:,.1f} µs, algbw {r.algbw_GBps:.3f}, "
        f"busbw {r.busbw_GBps:.3f} GB/s"
        for r in series
    ]
    for col, y in ((1, [r.time_s for r in series]), (2, [r.busbw_GBps for r in series])):
        fig.add_trace(
            go.Scatter(
                x=sizes,
                y=y,
                mode="markers+lines",
                name=name,
                legendgroup=name,
                showlegend=col == 1,
                line={"color": color, "dash": dash, "width": 1},
                marker={"size": 7},
                hovertext=hover,
                hoverinfo="text",
            ),
            row=1,
            col=col,
        )


def _add_alpha_beta_fit(
    fig: go.Figure, fit: AlphaBetaFit, sizes: list[int], name: str, color: str
) -> None:
    """The fitted α-β line over the measured times, and its 1/β as the level busbw tends to.

    Drawn over the same sizes as the measurement, so the eye compares model and points where
    both exist; the bandwidth line is the asymptote, since α stops mattering at large sizes.
    """
    fig.add_trace(
        go.Scatter(
            x=sizes,
            y=[fit.predict(s) for s in sizes],
            mode="lines",
            name=f"α-β fit: α={fit.alpha_s * 1e6:.0f} µs, 1/β={fit.bandwidth_GBps:.2f} GB/s",
            legendgroup=name,
            line={"color": color, "dash": "dash", "width": 2},
            opacity=0.6,
            hoverinfo="skip",
        ),
        row=1,
        col=1,
    )
    fig.add_trace(
        go.Scatter(
            x=[sizes[0], sizes[-1]],
            y=[fit.bandwidth_GBps] * 2,
            mode="lines",
            showlegend=False,
            legendgroup=name,
            line={"color": color, "dash": "dash", "width": 1},
            opacity=0.6,
            hoverinfo="skip",
        ),
        row=1,
        col=2,
    )


def _bandwidth_axes(fig: go.Figure, rows: Sequence[BandwidthRow], title: str) -> go.Figure:
    """Log size axes labelled in bytes (about six ticks), log time, busbw from zero."""
    all_sizes = sorted({r.size_bytes for r in rows})
    ticks = _size_ticks(all_sizes[:: max(1, len(all_sizes) // 6)])
    for col in (1, 2):
        fig.update_xaxes(type="log", title_text="message size", row=1, col=col, **ticks)
    fig.update_yaxes(type="log", title_text="seconds", row=1, col=1)
    fig.update_yaxes(title_text="GB/s (1e9 B/s)", rangemode="tozero", row=1, col=2)
    layout(fig, title=title, height=480)
    return fig.update_layout(margin={"t": 90, "b": 60}, legend={"y": -0.3})


def bandwidth_figure(
    rows: Sequence[BandwidthRow | Mapping[str, Any]],
    fits: Mapping[tuple[str, int], AlphaBetaFit] | None = None,
    *,
    title: str = "All-reduce: time and bus bandwidth against size",
) -> go.Figure:
    """Left: time against size, log-log, measured points and the fitted α-β line. Right: busbw
    against size, with the fitted bandwidth 1/β dashed (busbw tends to it for large sizes)."""
    rows = [_as_row(r) for r in rows]
    if not rows:
        raise ValueError("no rows to plot: run the bandwidth bench first")
    fig = make_subplots(
        rows=1,
        cols=2,
        subplot_titles=("time per all-reduce", "bus bandwidth (nccl-tests' busbw)"),
        horizontal_spacing=0.12,
    )
    for algorithm, n, series in _series_by_algorithm(rows):
        color = ALGORITHM_COLORS.get(algorithm, COLORS["predicted"])
        name = f"{ALGORITHM_NAMES.get(algorithm, algorithm)}, N={n}"
        _add_measured_series(fig, series, name, color, "solid" if n == 2 else "dot")
        fit = (fits or {}).get((algorithm, n))
        if fit is not None:
            _add_alpha_beta_fit(fig, fit, [r.size_bytes for r in series], name, color)
    return _bandwidth_axes(fig, rows, title)


# ---------------------------------------------------------------------------------------------
# The ring, step by step


def _contributors_label(members: frozenset[int], n: int) -> str:
    if len(members) == n:
        return "Σ" if n > 1 else "0"
    # In a ring, a partial sum always holds an arc of consecutive ranks: name its ends.
    start = next(r for r in members if (r - 1) % n not in members)
    arc = [(start + i) % n for i in range(len(members))]
    if len(arc) <= 3:
        return "+".join(str(r) for r in arc)
    return f"{arc[0]}+…+{arc[-1]}"


def _arrow(fig: go.Figure, x: float, y_from: float, y_to: float, color: str) -> None:
    fig.add_annotation(
        x=x, y=y_to, ax=x, ay=y_from, axref="x", ayref="y", xref="x", yref="y", text="",
        showarrow=True, arrowhead=2, arrowsize=1.1, arrowwidth=2, arrowcolor=color,
    )  # fmt: skip


def describe_ring_step(world_size: int, step: int, numel: int | None = None) -> str:
    """One sentence for the caption: what moves at ``step`` and what the receiver does."""
    n = check_world_size(world_size)
    total = ring_steps(n)
    if not 0 <= step <= total:
        raise ValueError(f"step must be in 0..{total} for world size {n}, got {step!r}")
    if step == 0:
        return (
            f"Before any message: each of the {n} ranks holds only its own gradient, cut into "
            f"{n} chunks. The ring makes {total} steps."
        )
    phase = ring_phase(step, n)
    k = step if phase == REDUCE_SCATTER else step - (n - 1)
    if numel is None:
        share = "S/N of the tensor"
    else:
        lo, hi = numel // n, -(-numel // n)
        share = f"{lo} element{'s' * (lo != 1)}" if lo == hi else f"{lo} or {hi} elements"
    if phase == REDUCE_SCATTER:
        what = "adds the chunk it receives into its own copy"
        after = " After this step every rank owns one fully summed chunk (Σ)." if k == n - 1 else ""
    else:
        what = "overwrites its copy with the finished chunk it receives"
        after = " Every rank now holds the full sum." if k == n - 1 else ""
    return (
        f"Step {step} of {total} ({phase} {k}/{n - 1}): every rank sends one chunk ({share}) to "
        f"its right neighbour and {what}.{after}"
    )


def _ring_grid(state: Any, n: int, bounds: Any, numel: int | None) -> go.Figure:
    """The N×N grid of chunks: whose contributions each rank's copy of each chunk holds."""
    z = [[len(state[r][c]) for c in range(n)] for r in range(n)]
    text = [[_contributors_label(state[r][c], n) for c in range(n)] for r in range(n)]
    hover = [
        [
            f"rank {r}, chunk {c}: sum of ranks {sorted(state[r][c])}"
            + ("" if numel is None else f"<br>elements [{bounds[c][0]}, {bounds[c][1]})")
            for c in range(n)
        ]
        for r in range(n)
    ]
    return go.Figure(
        go.Heatmap(
            z=z,
            x=list(range(n)),
            y=list(range(n)),
            zmin=1,
            zmax=n,
            text=text,
            texttemplate="%{text}",
            textfont={"size": 13 if n <= 5 else 10},
            hovertext=hover,
            hoverinfo="text",
            colorscale=[[0.0, "#EEEEEE"], [0.999, "#F9C48A"], [1.0, COLORS["allreduce"]]],
            showscale=False,
            xgap=3,
            ygap=3,
        )
    )


def _draw_moves(fig: go.Figure, moves: list[Any], n: int, arrow_color: str) -> None:
    """This step's messages: an outline on the receiving cell and an arrow from the sender."""
    for t in moves:
        c = t.chunk
        fig.add_shape(
            type="rect",
            x0=c - 0.5,
            x1=c + 0.5,
            y0=t.dst - 0.5,
            y1=t.dst + 0.5,
            line={"color": arrow_color, "width": 3},
        )
        x = c + 0.3
        if t.dst == t.src + 1:
            _arrow(fig, x, t.src + 0.1, t.dst - 0.12, arrow_color)
        else:  # the wrap-around message: leaves at the bottom, arrives at the top
            _arrow(fig, x, t.src + 0.1, n - 0.05, arrow_color)
            _arrow(fig, x, -0.95, t.dst - 0.12, arrow_color)
            for y, label in ((n - 0.05, f"to rank {t.dst}"), (-0.95, f"from rank {t.src}")):
                fig.add_annotation(
                    x=x, y=y, text=label, showarrow=False, xanchor="right", font={"size": 10}
                )


def ring_step_figure(
    world_size: int,
    step: int,
    *,
    numel: int | None = None,
    element_size: int = 4,
    height: int | None = None,
) -> go.Figure:
    """Each rank's N chunks after ring ``step`` (0 = before anything moves), as rows of a grid.

    A cell shows whose contributions that rank's copy of that chunk holds ("0+1", "Σ" = all
    ranks); its colour darkens as contributions add up. Arrows show this step's messages, from
    rank r to rank r+1 in the same chunk column; the message from the last rank wraps round to
    rank 0 (the stubs at the bottom and top). Outlined cells just received a chunk.
    """
    n = check_world_size(world_size)
    if not 2 <= n <= 16:
        raise ValueError(f"world_size must be in 2..16 to draw the ring, got {world_size!r}")
    total = ring_steps(n)
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= total:
        raise ValueError(f"step must be an int in 0..{total} for world size {n}, got {step!r}")
    size = n if numel is None else check_count("numel", numel)
    element_size = check_count("element_size", element_size)
    states = ring_partial_sums(n)
    state = states[step]
    bounds = chunk_bounds(size, n)
    moves = [t for t in ring_schedule(n, size, element_size) if t.step == step]

    fig = _ring_grid(state, n, bounds, numel)
    arrow_color = "#333333" if step and ring_phase(step, n) == REDUCE_SCATTER else "#4C78A8"
    _draw_moves(fig, moves, n, arrow_color)
    sent = sum(
        t.nbytes for t in ring_schedule(n, size, element_size) if t.step <= step and t.src == 0
    )
    xlabels = [
        f"chunk {c}" if numel is None else f"chunk {c}<br>[{bounds[c][0]}:{bounds[c][1]})"
        for c in range(n)
    ]
    fig.update_xaxes(tickvals=list(range(n)), ticktext=xlabels, side="top", range=[-0.6, n - 0.4])
    fig.update_yaxes(
        tickvals=list(range(n)),
        ticktext=[f"rank {r}" for r in range(n)],
        range=[n + 0.1, -1.15],
        showgrid=False,
        zeroline=False,
    )
    title = (
        f"Ring all-reduce, N={n}: before any step"
        if step == 0
        else f"Ring all-reduce, N={n}: after step {step} of {total} ({ring_phase(step, n)})"
    )
    layout(fig, title=title, height=height or 150 + 52 * n)
    fig.update_layout(
        margin={"l": 70, "r": 20, "t": 110, "b": 75}, xaxis={"showgrid": False, "zeroline": False}
    )
    caption = describe_ring_step(n, step, numel)
    if numel is not None:
        caption += f" Rank 0 has sent {format_size(sent)} so far."
    fig.add_annotation(
        text="<br>".join(textwrap.wrap(caption, 100)),
        xref="paper",
        yref="paper",
        x=0,
        y=-0.02,
        yanchor="top",
        xanchor="left",
        showarrow=False,
        align="left",
        font={"size": 12},
    )
    return fig
