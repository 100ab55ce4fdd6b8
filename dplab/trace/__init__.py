"""Timelines of DDP steps: spans, metrics, Chrome/Perfetto export, and the tracer."""

from dplab.trace.bucket import Bucket
from dplab.trace.files import load_rank, load_run, save_rank, save_run
from dplab.trace.metrics import StepMetrics, step_metrics
from dplab.trace.observer import NullObserver, StepObserver
from dplab.trace.profiler import from_profiler
from dplab.trace.step import KINDS, Span, StepTrace, chrome_trace, lane, last_steps
from dplab.trace.sweep import best_cap, by_cap, sweep_row
from dplab.trace.tracer import Tracer

__all__ = [
    "KINDS",
    "Bucket",
    "NullObserver",
    "Span",
    "StepMetrics",
    "StepObserver",
    "StepTrace",
    "Tracer",
    "best_cap",
    "by_cap",
    "chrome_trace",
    "from_profiler",
    "lane",
    "last_steps",
    "load_rank",
    "load_run",
    "save_rank",
    "save_run",
    "step_metrics",
    "sweep_row",
]
