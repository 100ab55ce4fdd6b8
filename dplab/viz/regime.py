"""The comms-bound regime: T_compute and T_comm against the per-rank batch, measured and predicted.

The gradient's bytes do not depend on the batch, so T_comm is (nearly) flat while T_compute grows
with it; where the two lines cross the step stops waiting for the network. Measured medians are
drawn as points with their min-max spread as error bars, so the noise is on the figure; the
simulator's prediction for the same batches is a dashed line of the same colour. The figure only
draws: :mod:`dplab.sim.regime` measures and predicts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go

from dplab.viz.style import COLORS, layout

SERIES = (
    ("t_compute_ms", "T_compute (backward)", COLORS["backward"]),
    ("t_comm_ms", "T_comm (all-reduce union)", COLORS["allreduce"]),
    ("exposed_ms", "exposed comm", COLORS["exposed"]),
)


def _check_points(points: Sequence[Any], what: str) -> list[Any]:
    points = sorted(points, key=lambda p: p.batch)
    if not points:
        raise ValueError(f"no {what} points to draw")
    for p in points:
        for key, _, _ in SERIES:
            if not hasattr(p, key):
                raise ValueError(f"a {what} point has no {key!r}: {p!r}")
    return points


def regime_figure(
    measured: Sequence[Any],
    predicted: Sequence[Any] | None = None,
    *,
    title: str = "The comms-bound regime: per-rank batch sweep",
    height: int = 380,
) -> go.Figure:
    """Measured (points, min-max bars) and predicted (dashed) T_compute, T_comm and exposed ms.

    Args:
        measured: :class:`dplab.sim.regime.RegimePoint` per batch (``measured_regime``).
        predicted: the simulator's points for the same batches (``predicted_regime``), or None.
        title: the figure's title.
        height: pixels.
    """
    measured = _check_points(measured, "measured")
    fig = go.Figure()
    x = [p.batch for p in measured]
    for key, label, color in SERIES:
        y = [getattr(p, key) for p in measured]
        lo = [p.spread[key][0] if key in p.spread else v for p, v in zip(measured, y, strict=True)]
        hi = [p.spread[key][1] if key in p.spread else v for p, v in zip(measured, y, strict=True)]
        fig.add_trace(
            go.Scatter(
                x=x,
                y=y,
                mode="markers+lines",
                line={"color": color, "width": 1},
                marker={"color": color, "size": 9},
                error_y={
                    "type": "data",
                    "symmetric": False,
                    "array": [h - v for h, v in zip(hi, y, strict=True)],
                    "arrayminus": [v - low for v, low in zip(y, lo, strict=True)],
                    "color": color,
                },
                name=f"{label}, measured",
                hovertemplate=f"batch %{{x}}<br>{label}: %{{y:.1f}} ms<extra>measured</extra>",
            )
        )
    if predicted:
        predicted = _check_points(predicted, "predicted")
        for key, label, color in SERIES:
            fig.add_trace(
                go.Scatter(
                    x=[p.batch for p in predicted],
                    y=[getattr(p, key) for p in predicted],
                    mode="lines",
                    line={"color": color, "dash": "dash", "width": 2},
                    name=f"{label}, simulated",
                    hovertemplate=f"batch %{{x}}<br>{label}: %{{y:.1f}} ms<extra>simulated</extra>",
                )
            )
    fig.update_xaxes(title="samples per rank", type="log", tickvals=x, ticktext=[str(b) for b in x])
    fig.update_yaxes(title="ms per step", rangemode="tozero")
    return layout(fig, title=title, height=height)


__all__ = ["regime_figure"]
