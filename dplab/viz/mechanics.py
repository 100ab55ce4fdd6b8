"""Figures for §3: bytes per phase, activation memory against A, and the LR-scaling curves.

Each takes what the rank functions in :mod:`dplab.mechanics` returned; nothing here measures.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dplab._units import KIB
from dplab.viz.style import COLORS, layout

OP_COLORS = {
    "broadcast": COLORS["weights"],
    "all_reduce": COLORS["allreduce"],
    "all_gather": COLORS["wait"],
}

RUN_COLORS = {
    "B, η": COLORS["forward"],
    "kB, η": COLORS["wait"],
    "kB, kη": COLORS["exposed"],
    "kB, kη + warm-up": COLORS["optimizer"],
}


def traffic_figure(result: Mapping[str, Any], *, title: str | None = None) -> go.Figure:
    """Bytes handed to collectives in each phase of a ``train_run``, stacked by collective, with
    the gradient bytes and the weight bytes as dashed lines."""
    comm = result["comm"]
    if not comm:
        raise ValueError("this run made no collective calls (world size 1?): nothing to draw")
    phases = list(dict.fromkeys(r["phase"] for r in comm))
    ops = list(dict.fromkeys(r["op"] for r in comm))
    fig = go.Figure()
    for op in ops:
        kib = [
            sum(r["nbytes"] for r in comm if r["op"] == op and r["phase"] == p) / KIB
            for p in phases
        ]
        calls = [sum(1 for r in comm if r["op"] == op and r["phase"] == p) for p in phases]
        fig.add_bar(
            x=phases,
            y=kib,
            name=op,
            marker_color=OP_COLORS.get(op, COLORS["predicted"]),
            customdata=calls,
            hovertemplate=f"{op}: %{{customdata}} call(s), %{{y:,.1f}} KiB<extra></extra>",
        )
    fig.add_hline(
        y=result["grad_bytes"] / KIB,
        line_dash="dash",
        line_color=COLORS["grads"],
        annotation_text="gradient bytes",
        annotation_position="top right",
    )
    fig.update_layout(barmode="stack")
    fig.update_yaxes(title_text="KiB handed to collectives (this rank)", rangemode="tozero")
    n = result["world_size"]
    return layout(
        fig,
        title=title or f"What rank {result['rank']} of {n} communicated, phase by phase",
        height=340,
    )


def activation_memory_figure(rows: Sequence[Mapping[str, Any]]) -> go.Figure:
    """Peak saved-for-backward bytes of one optimizer step against the accumulation count A."""
    if not rows:
        raise ValueError("no rows to draw")
    labels = [f"A={r['accum']}<br>micro-batch {r['micro_batch']}" for r in rows]
    fig = go.Figure(
        go.Bar(
            x=labels,
            y=[r["peak_bytes"] / KIB for r in rows],
            marker_color=COLORS["activations"],
            text=[f"{r['peak_bytes'] / KIB:,.1f} KiB" for r in rows],
            textposition="outside",
            hovertemplate="%{x}: %{y:,.1f} KiB<extra></extra>",
            name="peak activations",
        )
    )
    fig.update_yaxes(title_text="peak activations (KiB)", rangemode="tozero")
    local = rows[0]["local_batch"]
    return layout(
        fig,
        title=f"Same local batch ({local}), same gradient: the micro-batch sets activation memory",
        height=340,
    )


def loss_curves_figure(
    runs: Mapping[str, Mapping[str, Any]], *, target: float | None = None
) -> go.Figure:
    """Left: excess loss against epochs (log scale), one line per run; a diverged run ends in a
    cross at the step it blew up. Right: each run's learning rate against epochs."""
    if not runs:
        raise ValueError("no runs to draw")
    fig = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.66, 0.34],
        subplot_titles=("excess loss over the true rates (log scale)", "learning rate"),
        horizontal_spacing=0.1,
    )
    finite = [v for run in runs.values() for v in run["excess_loss"] if math.isfinite(v) and v > 0]
    if not finite:
        raise ValueError("every run diverged before its first evaluation: nothing to draw")
    # The y range ends a decade above the starting loss: a diverging run leaves through the top
    # (its cross marks where) instead of squashing every other curve into the bottom.
    start = max(run["excess_loss"][0] for run in runs.values())
    top = start * 10
    bottom = min(finite) / 2
    for label, run in runs.items():
        color = RUN_COLORS.get(label, COLORS["predicted"])
        name = f"{label}: B={run['batch']}, η={run['lr']:g}"
        if run["warmup_epochs"]:
            name += f", warm-up {run['warmup_epochs']:g} epoch"
        points = [
            (e, v)
            for e, v in zip(run["epochs"], run["excess_loss"], strict=True)
            if math.isfinite(v)
        ]
        fig.add_scatter(
            x=[e for e, _ in points],
            y=[max(v, 1e-6) for _, v in points],
            mode="lines+markers" if len(points) < 12 else "lines",
            name=name,
            legendgroup=label,
            line={"color": color, "width": 2},
            row=1,
            col=1,
        )
        if run["diverged_at_step"] is not None:
            epoch = run["diverged_at_step"] / run["steps_per_epoch"]
            fig.add_scatter(
                x=[epoch],
                y=[top / 2],
                mode="markers+text",
                marker={"symbol": "x", "size": 14, "color": color},
                text=[f"diverged at step {run['diverged_at_step']}"],
                textposition="middle right",
                showlegend=False,
                legendgroup=label,
                row=1,
                col=1,
            )
        spe = run["steps_per_epoch"]
        fig.add_scatter(
            x=[(i + 1) / spe for i in range(len(run["lrs"]))],
            y=run["lrs"],
            mode="lines",
            line={"color": color, "width": 2},
            showlegend=False,
            legendgroup=label,
            row=1,
            col=2,
        )
    if target is not None:
        fig.add_hline(y=target, line_dash="dot", line_color="#888888", row=1, col=1)
    fig.update_yaxes(
        type="log",
        title_text="excess loss",
        range=[math.log10(bottom), math.log10(top)],
        row=1,
        col=1,
    )
    fig.update_yaxes(type="log", title_text="η", row=1, col=2)
    fig.update_xaxes(title_text="epochs (samples seen / data set)", row=1, col=1)
    fig.update_xaxes(title_text="epochs", row=1, col=2)
    return layout(fig, title="Linear LR scaling: same epochs, k× the batch", height=430)


AXIS_COLORS = {"tp": COLORS["exposed"], "pp": COLORS["allreduce"], "dp": COLORS["optimizer"]}
REPLICA_COLORS = (COLORS["forward"], COLORS["backward"], COLORS["wait"], COLORS["predicted"])


def parallel3d_figure(layout3d: Any, syncs: Mapping[str, int], *, title: str) -> go.Figure:
    """Left: every GPU of a 3D-parallel job, a row per node, coloured by its DP replica and
    labelled with its pipeline stage and TP rank. Right: how often each axis syncs per step.

    ``layout3d`` is a :class:`dplab.mechanics.parallel3d.Layout3D`; ``syncs`` its
    ``syncs_per_step(...)``.
    """
    fig = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.62, 0.38],
        subplot_titles=("the GPUs, one row per node", "blocking syncs per GPU per optimizer step"),
    )
    per_node = layout3d.gpus_per_node
    for replica in range(layout3d.dp):
        ranks = [r for r in range(layout3d.world_size) if layout3d.coords(r)["dp"] == replica]
        fig.add_trace(
            go.Scatter(
                x=[r % per_node for r in ranks],
                y=[layout3d.node_of(r) for r in ranks],
                mode="markers+text",
                marker={
                    "symbol": "square",
                    "size": 34,
                    "color": REPLICA_COLORS[replica % len(REPLICA_COLORS)],
                },
                text=[f"s{layout3d.coords(r)['pp']}·t{layout3d.coords(r)['tp']}" for r in ranks],
                textfont={"size": 10, "color": "white"},
                hovertext=[f"rank {r}: {layout3d.coords(r)}" for r in ranks],
                hoverinfo="text",
                name=f"DP replica {replica}",
            ),
            row=1,
            col=1,
        )
    fig.update_xaxes(title_text="GPU on the node", dtick=1, row=1, col=1)
    fig.update_yaxes(
        title_text="node",
        dtick=1,
        autorange="reversed",
        range=[-0.6, layout3d.nodes - 0.4],
        row=1,
        col=1,
    )
    axes = [a for a in ("tp", "pp", "dp") if syncs.get(a)]
    fig.add_trace(
        go.Bar(
            x=[a.upper() for a in axes],
            y=[syncs[a] for a in axes],
            marker_color=[AXIS_COLORS[a] for a in axes],
            text=[str(syncs[a]) for a in axes],
            textposition="outside",
            showlegend=False,
        ),
        row=1,
        col=2,
    )
    fig.update_yaxes(type="log", title_text="syncs per step", row=1, col=2)
    return layout(fig, title=title, height=420)
