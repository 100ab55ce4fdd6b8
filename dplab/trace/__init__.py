"""Timelines of DDP steps: spans, metrics, Chrome/Perfetto export, and the tracer."""

from dplab.trace.metrics import StepMetrics, step_metrics
from dplab.trace.step import KINDS, Span, StepTrace, chrome_trace, lane
from dplab.trace.tracer import Tracer

__all__ = [
    "KINDS",
    "Span",
    "StepMetrics",
    "StepTrace",
    "Tracer",
    "chrome_trace",
    "lane",
    "step_metrics",
]
