"""Timelines of DDP steps: spans, metrics, Chrome/Perfetto export, and the tracer."""

from dplab.trace.cli import add_cli
from dplab.trace.files import load_rank, load_run, save_rank, save_run
from dplab.trace.metrics import StepMetrics, step_metrics
from dplab.trace.observer import NullObserver, StepObserver
from dplab.trace.step import KINDS, Span, StepTrace, chrome_trace, lane
from dplab.trace.tracer import Tracer

__all__ = [
    "KINDS",
    "NullObserver",
    "Span",
    "StepMetrics",
    "StepObserver",
    "StepTrace",
    "Tracer",
    "add_cli",
    "chrome_trace",
    "lane",
    "load_rank",
    "load_run",
    "save_rank",
    "save_run",
    "step_metrics",
]
