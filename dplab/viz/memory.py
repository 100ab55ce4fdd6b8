"""Memory figures: what one rank holds, part by part, against the GPU's capacity.

* :func:`memory_vs_world_size` — per-rank bytes against the world size N for plain DP (flat: every
  rank holds a full copy) and the ZeRO stages (falling as 1/N towards what they leave unsharded);
* :func:`fit_figure` — stacked bars (weights, grads, master weights, optimizer state,
  activations) per rank with the GPU's capacity as a line, beside the curve against N, for one
  :class:`~dplab.memory.fit.Fit`, as the ``MemoryWall`` widget draws them.

Bytes are drawn in decimal gigabytes (1 GB = 10^9 bytes), the unit of the published figures, or
in MB (10^6 bytes) when everything drawn is below a gigabyte (the small models measured here).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dplab._units import GB
from dplab.memory.fit import Fit, fmt_gb, fmt_params
from dplab.memory.state import STAGE_LABELS, ZERO_STAGES, state_bytes
from dplab.viz.style import COLORS, layout

PART_LABELS = {
    "weights": "weights",
    "grads": "gradients",
    "master_weights": "fp32 master weights",
    "optimizer_state": "optimizer state",
    "activations": "activations",
}
PART_COLORS = {
    "weights": COLORS["weights"],
    "grads": COLORS["grads"],
    "master_weights": COLORS["master_weights"],
    "optimizer_state": COLORS["optimizer_state"],
    "activations": COLORS["activations"],
}
STAGE_COLORS = {0: "#555555", 1: "#F58518", 2: "#54A24B", 3: "#4C78A8"}
STAGE_DASH = {0: "solid", 1: "dash", 2: "dashdot", 3: "dot"}
UNITS = {"GB": (GB, "10⁹"), "MB": (10**6, "10⁶")}


def pick_unit(unit: str, largest_bytes: float) -> str:
    """``"auto"`` → GB, or MB when the largest value drawn is under a gigabyte."""
    if unit == "auto":
        return "GB" if largest_bytes >= GB else "MB"
    if unit not in UNITS:
        raise ValueError(f"unit must be 'auto', 'GB' or 'MB', got {unit!r}")
    return unit


def _axis_title(unit: str) -> str:
    return f"{unit} per rank ({UNITS[unit][1]} bytes)"


def _bar_traces(
    columns: Sequence[tuple[str, Mapping[str, int]]], *, unit: str = "GB", legend: bool = True
):
    labels = [label for label, _ in columns]
    scale = UNITS[unit][0]
    traces = []
    for part, name in PART_LABELS.items():
        values = [parts.get(part, 0) / scale for _, parts in columns]
        if not any(values):
            continue
        traces.append(
            go.Bar(
                x=labels,
                y=values,
                name=name,
                marker_color=PART_COLORS[part],
                legendgroup=part,
                showlegend=legend,
                hovertemplate=f"{name}: %{{y:.3s}} {unit}<extra>%{{x}}</extra>",
            )
        )
    return traces


def _capacity_line(
    fig: go.Figure, capacity_bytes: int, label: str, *, unit: str = "GB", **where
) -> None:
    fig.add_hline(
        y=capacity_bytes / UNITS[unit][0],
        line={"color": COLORS["capacity"], "width": 2, "dash": "dash"},
        annotation_text=label,
        annotation_position="top right",
        annotation_font_color=COLORS["capacity"],
        **where,
    )


def _capacity_trace(
    x: Sequence[int], capacity_bytes: int, label: str, *, unit: str = "GB", legend: bool = True
):
    """Capacity as a line *trace*: shapes on a log axis take log10 coordinates, traces do not."""
    return go.Scatter(
        x=[min(x), max(x)],
        y=[capacity_bytes / UNITS[unit][0]] * 2,
        mode="lines",
        name=label,
        line={"color": COLORS["capacity"], "width": 2, "dash": "dash"},
        showlegend=legend,
        hovertemplate=f"{label}<extra></extra>",
    )


def world_size_curves(
    n_params: int,
    world_sizes: Sequence[int],
    *,
    precision: str = "mixed",
    optimizer: str = "adam",
    activations: int = 0,
) -> dict[int, list[int]]:
    """Per-rank bytes (state + activations) at each world size, for each ZeRO stage."""
    return {
        stage: [
            state_bytes(
                n_params,
                world_size=n,
                zero_stage=stage,
                precision=precision,
                optimizer=optimizer,
            ).total
            + activations
            for n in world_sizes
        ]
        for stage in ZERO_STAGES
    }


def _curve_traces(
    world_sizes: Sequence[int],
    curves: Mapping[int, Sequence[int]],
    *,
    measured: Mapping[int, int] | None = None,
    measured_by_stage: Mapping[int, Mapping[int, int]] | None = None,
    unit: str = "GB",
    legend: bool = True,
):
    scale = UNITS[unit][0]
    traces = [
        go.Scatter(
            x=list(world_sizes),
            y=[b / scale for b in curves[stage]],
            mode="lines+markers",
            name=STAGE_LABELS[stage],
            line={"color": STAGE_COLORS[stage], "dash": STAGE_DASH[stage], "width": 2},
            marker={"size": 5},
            showlegend=legend,
            hovertemplate=f"{STAGE_LABELS[stage]}, N=%{{x}}: %{{y:.3s}} {unit}<extra></extra>",
        )
        for stage in ZERO_STAGES
    ]
    if measured:
        traces.append(
            go.Scatter(
                x=list(measured),
                y=[b / scale for b in measured.values()],
                mode="markers",
                name="measured (plain DP)",
                marker={"symbol": "x", "size": 11, "color": "#333333"},
                showlegend=legend,
                hovertemplate=f"measured, N=%{{x}}: %{{y:.3s}} {unit}<extra></extra>",
            )
        )
    for stage, points in (measured_by_stage or {}).items():
        label = f"measured, {STAGE_LABELS[stage]}"
        traces.append(
            go.Scatter(
                x=list(points),
                y=[b / scale for b in points.values()],
                mode="markers",
                name=label,
                marker={"symbol": "x", "size": 12, "color": STAGE_COLORS[stage]},
                showlegend=legend,
                hovertemplate=f"{label}, N=%{{x}}: %{{y:.3s}} {unit}<extra></extra>",
            )
        )
    return traces


def memory_vs_world_size(
    n_params: int,
    *,
    world_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
    precision: str = "mixed",
    optimizer: str = "adam",
    activations: int = 0,
    capacity_bytes: int | None = None,
    capacity_label: str = "GPU capacity",
    measured: Mapping[int, int] | None = None,
    measured_by_stage: Mapping[int, Mapping[int, int]] | None = None,
    title: str = "Memory per rank against the world size",
    unit: str = "auto",
    height: int = 380,
) -> go.Figure:
    """Per-rank bytes against N: plain DP stays flat, each ZeRO stage falls as 1/N.

    ``measured`` maps world sizes to bytes measured on real ranks under plain DP; they are drawn
    as crosses. ``measured_by_stage`` does the same for each ZeRO stage (stage → {N: bytes}, as
    §9b measures them with :func:`dplab.sharding.sharded_step`), crosses in the stage's colour
    beside its curve, so a measurement that left the formula shows as a cross off its line.
    """
    curves = world_size_curves(
        n_params,
        world_sizes,
        precision=precision,
        optimizer=optimizer,
        activations=activations,
    )
    for stage in measured_by_stage or {}:
        if stage not in ZERO_STAGES:
            raise ValueError(f"measured_by_stage keys are ZeRO stages 0..3, got {stage!r}")
    points = [b for m in (measured_by_stage or {}).values() for b in m.values()]
    largest = max([max(c) for c in curves.values()] + list((measured or {}).values()) + points)
    unit = pick_unit(unit, max(largest, capacity_bytes or 0))
    fig = go.Figure(
        _curve_traces(
            world_sizes, curves, measured=measured, measured_by_stage=measured_by_stage, unit=unit
        )
    )
    if capacity_bytes is not None:
        fig.add_trace(_capacity_trace(world_sizes, capacity_bytes, capacity_label, unit=unit))
    fig.update_xaxes(type="log", title_text="world size N (ranks)", dtick=0.30103)
    fig.update_yaxes(type="log", title_text=_axis_title(unit))
    return layout(fig, title=title, height=height)


def _world_sizes_around(n: int) -> list[int]:
    top = max(1024, 1 << (max(n, 1) - 1).bit_length())
    sizes = [1 << k for k in range(top.bit_length())]
    return sorted(set(sizes) | {n})


MeasuredPerParam = Mapping[tuple[str, str], Mapping[int, Mapping[int, float]]]


def fit_figure(
    fit: Fit, *, measured: MeasuredPerParam | None = None, height: int = 480
) -> go.Figure:
    """One rank of ``fit``'s job: the four stages' bars at its world size, and memory against N.

    The chosen stage's bar is labelled with an arrow; the chosen (N, stage) is ringed on the
    right-hand panel. ``measured`` maps a recipe ``(precision, optimizer)`` to stage → N →
    model-state bytes per parameter measured on real ranks (§9, §9b). The accounting is linear
    in the parameter count, so a measurement on a small GPT, times this model's count, is where
    this model's state must sit: the points of the fit's recipe are drawn as crosses on the
    curves (plus the same activations the curves carry).
    """
    st = fit.state
    columns = []
    for stage in ZERO_STAGES:
        parts = state_bytes(
            fit.n_params,
            world_size=st.world_size,
            zero_stage=stage,
            precision=st.precision,
            optimizer=st.optimizer,
        ).as_dict()
        label = STAGE_LABELS[stage] + (" ◀" if stage == st.zero_stage else "")
        columns.append((label, {**parts, "activations": fit.activations}))
    sizes = _world_sizes_around(st.world_size)
    curves = world_size_curves(
        fit.n_params,
        sizes,
        precision=st.precision,
        optimizer=st.optimizer,
        activations=fit.activations,
    )
    fig = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.45, 0.55],
        horizontal_spacing=0.1,
        subplot_titles=(
            f"per rank at N = {st.world_size:,}",
            "per rank against the world size N",
        ),
    )
    for trace in _bar_traces(columns):
        fig.add_trace(trace, row=1, col=1)
    for trace in _curve_traces(sizes, curves):
        fig.add_trace(trace, row=1, col=2)
    fig.add_trace(
        go.Scatter(
            x=[st.world_size],
            y=[fit.total / GB],
            mode="markers",
            name="this configuration",
            marker={"size": 16, "color": "rgba(0,0,0,0)", "line": {"color": "#333", "width": 2}},
            hovertemplate=f"{fmt_gb(fit.total)} per rank<extra></extra>",
        ),
        row=1,
        col=2,
    )
    for stage, points in (measured or {}).get((st.precision, st.optimizer), {}).items():
        label = f"measured per parameter, {STAGE_LABELS[stage]}"
        fig.add_trace(
            go.Scatter(
                x=list(points),
                y=[(bpp * fit.n_params + fit.activations) / GB for bpp in points.values()],
                mode="markers",
                name=label,
                marker={"symbol": "x", "size": 12, "color": STAGE_COLORS[stage]},
                customdata=list(points.values()),
                hovertemplate=f"{label}, N=%{{x}}: %{{customdata:.2f}} B/param × "
                f"{fmt_params(fit.n_params)} + activations = %{{y:.3s}} GB<extra></extra>",
            ),
            row=1,
            col=2,
        )
    cap_label = f"{fit.gpu.name}: {fit.gpu.memory_gib} GiB = {fmt_gb(fit.gpu.capacity_bytes)}"
    _capacity_line(fig, fit.gpu.capacity_bytes, cap_label, row=1, col=1)
    fig.add_trace(_capacity_trace(sizes, fit.gpu.capacity_bytes, cap_label), row=1, col=2)
    fig.update_layout(barmode="stack")
    fig.update_yaxes(title_text=_axis_title("GB"), row=1, col=1)
    fig.update_xaxes(type="log", dtick=0.30103, title_text="world size N", row=1, col=2)
    fig.update_yaxes(type="log", row=1, col=2)
    name = fit.model.name if fit.model.key != "custom" else "custom model"
    title = f"{name}: {fmt_params(fit.n_params)} on {fit.gpu.name}"
    fig = layout(fig, title=title, height=height)
    fig.update_layout(margin={"t": 80, "b": 120}, legend={"y": -0.25})
    fig.update_annotations(yshift=4, selector={"text": f"per rank at N = {st.world_size:,}"})
    return fig
