"""ZeRO-3's price and what it buys, per fabric and world size: the simulator's prediction.

Left, how much longer ZeRO-3's step is than DDP's (%), with the threshold the caller calls "too
much" dashed; right, the model state per rank ZeRO-3 saves (GB). Nothing here measures: the rows
come from :func:`dplab.sim.sharded.zero3_costs`, a prediction for machines this course cannot
run, and the title says so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dplab.sim.sharded import Zero3Cost
from dplab.viz.style import layout


def zero3_cost_figure(
    rows_by_fabric: Mapping[str, Sequence[Zero3Cost]],
    *,
    max_extra: float = 0.10,
    title: str = "ZeRO-3 vs DDP at scale (the simulator's prediction, not a measurement)",
) -> go.Figure:
    """One line per fabric: extra step time (%) and memory saved per rank (GB) vs world size."""
    if not rows_by_fabric or not all(rows_by_fabric.values()):
        raise ValueError("no ZeRO-3 cost rows to draw (every fabric needs at least one)")
    fig = make_subplots(
        rows=1, cols=2, subplot_titles=("ZeRO-3's extra step time", "model state saved per rank")
    )
    for name, rows in rows_by_fabric.items():
        rows = sorted(rows, key=lambda r: r.world_size)
        n = [r.world_size for r in rows]
        fig.add_trace(
            go.Scatter(
                x=n,
                y=[100 * r.extra_fraction for r in rows],
                name=name,
                mode="lines+markers",
                legendgroup=name,
            ),
            row=1,
            col=1,
        )
        fig.add_trace(
            go.Scatter(
                x=n,
                y=[r.saved_bytes / 1e9 for r in rows],
                name=name,
                mode="lines+markers",
                legendgroup=name,
                showlegend=False,
            ),
            row=1,
            col=2,
        )
    fig.add_hline(
        y=100 * max_extra, line_dash="dash", row=1, col=1, annotation_text=f"{max_extra:.0%}"
    )
    fig.update_xaxes(type="log", title_text="world size (GPUs)")
    fig.update_yaxes(title_text="% longer than DDP", row=1, col=1)
    fig.update_yaxes(title_text="GB", row=1, col=2)
    return layout(fig, title=title)
