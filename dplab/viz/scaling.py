"""Scaling efficiency: what fraction of N× the throughput N ranks deliver.

Measured points and the simulator's prediction at the same world sizes sit on one axis with the
simulator's curve for a GPU cluster, so a learner sees both where the model was checked (a few
real ranks) and how far it is extrapolated (to 1,024 GPUs), and that the two kinds of point lose
efficiency for different reasons (shared CPU cores here, communication there).
"""

from __future__ import annotations

from collections.abc import Mapping

import plotly.graph_objects as go

from dplab.viz.style import COLORS, layout


def efficiency(step_ms: Mapping[int, float]) -> dict[int, float]:
    """Weak-scaling efficiency from step times at a fixed per-rank batch: the step at the
    smallest world size over the step at N (1 when N ranks deliver N× the samples per second)."""
    if not step_ms or min(step_ms.values()) <= 0:
        raise ValueError(f"step times must be positive, by world size; got {dict(step_ms)!r}")
    base = step_ms[min(step_ms)]
    return {n: base / ms for n, ms in sorted(step_ms.items())}


def scaling_figure(
    measured: Mapping[int, float],
    predicted: Mapping[int, float],
    at_scale: Mapping[int, float],
    *,
    at_scale_label: str = "simulated GPU cluster",
    title: str = "Scaling efficiency",
    height: int = 380,
) -> go.Figure:
    """Efficiency by world size (log axis). Each mapping is world size → step ms at a fixed
    per-rank batch; each is normalised to its own smallest world size."""
    fig = go.Figure()
    top = 0.0
    series = (
        (measured, "measured on these ranks", COLORS["allreduce"], "markers", "circle"),
        (predicted, "simulated, same ranks", COLORS["predicted"], "markers", "circle-open"),
        (at_scale, at_scale_label, COLORS["forward"], "lines+markers", "diamond"),
    )
    for steps, name, color, mode, symbol in series:
        eff = efficiency(steps)
        top = max(top, *eff.values())
        fig.add_trace(
            go.Scatter(
                x=list(eff),
                y=list(eff.values()),
                name=name,
                mode=mode,
                marker={"color": color, "size": 11, "symbol": symbol},
                line={"color": color},
                hovertemplate="N = %{x}<br>efficiency %{y:.0%}<extra>" + name + "</extra>",
            )
        )
    fig.update_xaxes(type="log", title="world size N (ranks or GPUs)")
    fig.update_yaxes(
        title="efficiency (1 = N× the throughput)",
        range=[0, max(1.1, 1.05 * top)],
        tickformat=".0%",
    )
    return layout(fig, title=title, height=height)
