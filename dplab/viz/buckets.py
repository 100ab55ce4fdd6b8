"""The bucket map: which parameters share an all-reduce, and in what order they go.

One row per bucket, bucket 0 (the first to be all-reduced) on top; each parameter is a segment,
as wide as its gradient's bytes when the sizes are known. The colour is the parameter's place in
the model's registration order, so the picture shows at a glance why buckets are cut in
*reverse*: bucket 0 holds the last layers, whose gradients backward produces first, and the
embeddings (registered first) end up in the last bucket, the one that can only start when
backward is over. Dashed lines mark the caps: a bucket closes at the first parameter that takes
it to its cap or over, since a parameter is never split.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go

from dplab._units import MIB
from dplab.viz.style import COLORS, layout

ROW_PX = 26


def _rows(buckets: Any) -> list[dict[str, Any]]:
    """Buckets as ``{index, param_names, nbytes}`` from Bucket objects, dicts, a StepTrace or a
    DDP (anything with ``.buckets``)."""
    if hasattr(buckets, "buckets") and not isinstance(buckets, Sequence):
        buckets = buckets.buckets
    if not isinstance(buckets, Sequence) or isinstance(buckets, (str, bytes)):
        raise ValueError(f"expected a list of buckets, got {type(buckets).__name__}")
    if not buckets:
        raise ValueError("no buckets to draw")
    rows = []
    for b in buckets:
        if isinstance(b, Mapping):
            row = {
                "index": b.get("index"),
                "param_names": b.get("param_names"),
                "nbytes": b.get("nbytes"),
            }
        else:
            row = {
                "index": getattr(b, "index", None),
                "param_names": getattr(b, "param_names", None),
                "nbytes": getattr(b, "nbytes", None),
            }
        if row["index"] is None or row["param_names"] is None:
            raise ValueError(f"not a bucket (needs index and param_names): {b!r}")
        row["param_names"] = list(row["param_names"])
        rows.append(row)
    return sorted(rows, key=lambda r: r["index"])


def _short(name: str) -> str:
    return name.replace(".weight", ".w").replace(".bias", ".b")


def _segments(
    rows: list[dict[str, Any]], sizes: Mapping[str, int] | None, order: dict[str, int]
) -> tuple[dict[str, list], list[str], list[tuple[str, float, int, int | None]]]:
    """One bar segment per parameter, bucket by bucket; the bucket labels; per-bucket totals."""
    n_params = len(order)
    base, width, y, color, text, hover = [], [], [], [], [], []
    labels = []
    totals = []
    for r in rows:
        label = f"bucket {r['index']}"
        labels.append(label)
        offset = 0.0
        for name in r["param_names"]:
            size = sizes[name] / MIB if sizes is not None else 1.0
            base.append(offset)
            width.append(size)
            y.append(label)
            color.append(order.get(name, 0))
            text.append(_short(name))
            nbytes = f"{sizes[name]:,} B, " if sizes is not None else ""
            hover.append(
                f"{name}<br>{nbytes}bucket {r['index']}<br>registered #{order.get(name, 0)} "
                f"of {n_params}" + ("" if sizes is not None else " (from the bucket order)")
            )
            offset += size
        totals.append((label, offset, len(r["param_names"]), r["nbytes"]))

    bars = {"base": base, "x": width, "y": y, "color": color, "text": text, "hover": hover}
    return bars, labels, totals


def _annotate(
    fig: go.Figure,
    totals: list[tuple[str, float, int, int | None]],
    sizes: Mapping[str, int] | None,
    cap_mb: float | None,
    first_cap_mb: float | None,
) -> None:
    """Each bucket's parameter count and size at its end; the caps as dashed lines."""
    for label, end, count, nbytes in totals:
        size = f", {nbytes / MIB:.2f} MiB" if nbytes is not None else ""
        fig.add_annotation(
            x=end,
            y=label,
            text=f" {count} param{'s' if count != 1 else ''}{size}",
            showarrow=False,
            xanchor="left",
            font={"size": 11},
        )
    if sizes is not None:
        lines = [(first_cap_mb, "first-bucket cap"), (cap_mb, "cap")]
        if cap_mb is not None and first_cap_mb == cap_mb:
            lines = [(cap_mb, "cap (first bucket too)")]
        for cap, name in lines:
            if cap is not None:
                fig.add_vline(
                    x=cap,
                    line={"dash": "dash", "color": COLORS["capacity"], "width": 1},
                    annotation={"text": f"{name} {cap:g} MiB", "font": {"size": 11}},
                )


def bucket_map_figure(
    buckets: Any,
    param_sizes: Mapping[str, int] | None = None,
    *,
    cap_mb: float | None = None,
    first_cap_mb: float | None = None,
    title: str | None = None,
    height: int | None = None,
) -> go.Figure:
    """Draw the buckets.

    Args:
        buckets: ``ddp.buckets`` or ``trace.buckets`` (``dplab.Bucket``), dicts, a StepTrace
            or a DDP.
        param_sizes: ``{name: bytes}`` in registration order
            (``dplab.models.param_sizes_of``). With it
            segments are as wide as the gradients; without it every parameter is one cell and
            the colour is the bucket order reversed (registration order before any rebuild).
        cap_mb, first_cap_mb: draw the bucket caps (needs ``param_sizes``).
    """
    rows = _rows(buckets)
    in_buckets = [name for r in rows for name in r["param_names"]]
    if param_sizes is not None:
        sizes = dict(param_sizes)
        missing = [n for n in in_buckets if n not in sizes]
        if missing:
            raise ValueError(f"param_sizes has no size for {missing[0]!r} (a bucketed parameter)")
        order = {name: i for i, name in enumerate(sizes)}
        color_title = "registration<br>order"
    else:
        sizes = None
        order = {name: i for i, name in enumerate(reversed(in_buckets))}
        color_title = "bucket order<br>reversed"
    n_params = len(order)

    bars, labels, totals = _segments(rows, sizes, order)

    fig = go.Figure(
        go.Bar(
            orientation="h",
            base=bars["base"],
            x=bars["x"],
            y=bars["y"],
            text=bars["text"],
            textposition="inside",
            insidetextanchor="middle",
            textangle=0,
            hovertext=bars["hover"],
            hoverinfo="text",
            marker={
                "color": bars["color"],
                "colorscale": "Viridis",
                "cmin": 0,
                "cmax": max(n_params - 1, 1),
                "line": {"width": 1, "color": "white"},
                "colorbar": {"title": {"text": color_title}, "thickness": 12},
            },
            showlegend=False,
        )
    )
    _annotate(fig, totals, sizes, cap_mb, first_cap_mb)
    fig.update_yaxes(categoryorder="array", categoryarray=labels, autorange="reversed")
    drawn_caps = [c for c in (cap_mb, first_cap_mb) if c is not None and sizes is not None]
    fig.update_xaxes(range=[0, max([t[1] for t in totals] + drawn_caps) * 1.22])
    fig.update_xaxes(
        title_text="gradient bytes in the bucket (MiB)"
        if sizes is not None
        else "parameters in the bucket (one cell each)",
    )
    fig.update_layout(barmode="overlay", bargap=0.25, uniformtext={"minsize": 8, "mode": "hide"})
    n = len(rows)
    layout(
        fig,
        title=title
        or f"{n} bucket{'s' if n != 1 else ''}, all-reduced top to bottom (bucket 0 first)",
        height=height or max(220, ROW_PX * n + 130),
    )
    return fig
