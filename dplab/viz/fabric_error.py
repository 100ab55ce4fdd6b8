"""Where to trust the fabric model: its error by message size, on clusters it never saw.

One pair of bars per size band (``dplab.sim.validation_bands()``): the median factor between
predicted and measured time, and the worst. A factor of 1 is exact; the dashed line at 1.5 is
where the course stops calling a prediction good. DDP's buckets (1–32 MiB) sit in the middle
band, so a learner reading a predicted step time sees how far that band's all-reduces can be off.
"""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

from dplab.sim.validation import BandError
from dplab.viz.style import COLORS, layout

GOOD_FACTOR = 1.5


def fabric_error_figure(
    bands: Sequence[BandError],
    *,
    title: str = "Fabric model vs published nccl-tests runs (leave one source out)",
    height: int = 360,
) -> go.Figure:
    """Median and worst factor max(predicted/measured, measured/predicted) per size band.

    Args:
        bands: :class:`dplab.sim.BandError` records, e.g. ``dplab.sim.validation_bands()``.
        title: the figure's title.
        height: pixels.
    """
    bands = list(bands)
    if not bands or not all(isinstance(b, BandError) for b in bands):
        raise ValueError(f"bands must be BandError records (validation_bands()), got {bands!r}")
    x = [f"{b.band}<br>({b.rows} rows)" for b in bands]
    fig = go.Figure()
    for key, label, color in (
        ("median_factor", "median factor", COLORS["predicted"]),
        ("worst_factor", "worst factor", COLORS["exposed"]),
    ):
        fig.add_trace(
            go.Bar(
                x=x,
                y=[getattr(b, key) for b in bands],
                name=label,
                marker_color=color,
                text=[f"×{getattr(b, key):.2f}" for b in bands],
                textposition="outside",
                customdata=[b.worst_row for b in bands],
                hovertemplate=f"%{{x}}<br>{label} ×%{{y:.2f}}<br>worst: %{{customdata}}"
                "<extra></extra>",
            )
        )
    fig.add_hline(y=GOOD_FACTOR, line_dash="dash", line_color="#888888")
    fig.update_yaxes(title_text="× off (predicted vs measured)", type="log", rangemode="tozero")
    fig.update_layout(barmode="group")
    return layout(fig, title=title, height=height)
