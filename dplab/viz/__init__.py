"""Plotly figures of the course. Every figure takes data objects (StepTrace, memory breakdowns,
ring steps) and returns a ``plotly.graph_objects.Figure``; nothing here measures."""

from dplab.viz.buckets import bucket_map_figure
from dplab.viz.collectives import bandwidth_figure, ring_step_figure
from dplab.viz.mechanics import (
    activation_memory_figure,
    loss_curves_figure,
    parallel3d_figure,
    traffic_figure,
)
from dplab.viz.memory import fit_figure, memory_vs_world_size, world_size_curves
from dplab.viz.sharded import zero3_cost_figure
from dplab.viz.sweep import sweep_figure
from dplab.viz.timeline import timeline_figure

__all__ = [
    "activation_memory_figure",
    "bandwidth_figure",
    "bucket_map_figure",
    "fit_figure",
    "loss_curves_figure",
    "memory_vs_world_size",
    "parallel3d_figure",
    "ring_step_figure",
    "sweep_figure",
    "timeline_figure",
    "traffic_figure",
    "world_size_curves",
    "zero3_cost_figure",
]
