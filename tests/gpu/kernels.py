"""The CUDA-event spans of dplab.Tracer against the kernel times torch.profiler records.

The stand-in collective of :mod:`tests.gpu.ordering` runs real kernels on its side stream: a
``torch.cuda._sleep`` spin kernel, then the scaling kernel. In a Chrome trace that
``torch.profiler`` exports (CUPTI's kernel times, a clock dplab does not use), a bucket's
collective is the stretch from a spin kernel's start to the end of the next kernel on the same
stream. Pure functions over the trace's JSON, so the CPU tests can run them on a written trace.
"""

from __future__ import annotations

from typing import Any

SPIN = "spin_kernel"  # ATen's torch.cuda._sleep kernel
REL_TOL, ABS_TOL_US = 0.05, 50.0


def kernel_spans(trace: dict[str, Any], marker: str = SPIN) -> list[tuple[float, float]]:
    """(start_us, end_us) per stand-in collective: a ``marker`` kernel and the kernel after it on
    the same stream, in time order."""
    kernels = [
        e
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and e.get("cat") == "kernel" and "dur" in e
    ]
    by_stream: dict[Any, list[dict[str, Any]]] = {}
    for e in sorted(kernels, key=lambda e: e["ts"]):
        by_stream.setdefault(e.get("args", {}).get("stream", e.get("tid")), []).append(e)
    spans = []
    for events in by_stream.values():
        for i, e in enumerate(events):
            if marker not in e["name"]:
                continue
            if i + 1 >= len(events):
                raise ValueError(f"{marker} at {e['ts']} µs has no kernel after it on its stream")
            after = events[i + 1]
            spans.append((float(e["ts"]), float(after["ts"]) + float(after["dur"])))
    return sorted(spans)


def mismatches(
    ours_us: list[float], theirs_us: list[float], rel: float = REL_TOL, abs_us: float = ABS_TOL_US
) -> list[tuple[int, float, float]]:
    """(index, ours, theirs) of each duration outside ``rel`` or ``abs_us``; a count mismatch is
    an error (the n-th span must be the n-th collective)."""
    if len(ours_us) != len(theirs_us):
        raise AssertionError(
            f"{len(ours_us)} dplab spans but {len(theirs_us)} profiled collectives"
        )
    return [
        (i, a, b)
        for i, (a, b) in enumerate(zip(ours_us, theirs_us, strict=True))
        if abs(a - b) > max(rel * b, abs_us)
    ]
