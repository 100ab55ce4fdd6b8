"""Timelines of DDP steps: spans, metrics, Chrome/Perfetto export, and the tracer."""

from dplab._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    globals(),
    {
        "dplab.trace.bucket": ["Bucket"],
        "dplab.trace.files": ["load_rank", "load_run", "save_rank", "save_run"],
        "dplab.trace.metrics": ["StepMetrics", "step_metrics"],
        "dplab.trace.observer": ["NullObserver", "StepObserver"],
        "dplab.trace.profiler": ["from_profiler"],
        "dplab.trace.step": ["KINDS", "Span", "StepTrace", "chrome_trace", "lane", "last_steps"],
        "dplab.trace.sweep": ["best_cap", "by_cap", "sweep_row"],
        "dplab.trace.tracer": ["Tracer"],
    },
)
