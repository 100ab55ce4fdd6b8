"""``StepTrace``: one synchronising step of one rank as spans on a timeline.

Measured steps (from :class:`dplab.Tracer`) and simulated ones (from :func:`dplab.sim.simulate`)
are the same object, so the metrics, figures and widgets never care where a step came from.
Times are milliseconds from the step's start; ``origin_ms`` places that start on a time base
shared by all ranks (aligned at a barrier), so rank lanes line up in one figure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from dplab.trace.bucket import Bucket
from dplab.trace.metrics import COMM_KINDS, StepMetrics, step_metrics

KINDS = ("forward", "backward", "bucket_ready", "wait", "optimizer", *COMM_KINDS)
CLOCKS = ("host", "cuda_event", "simulated")
FORMAT = "dplab.steptrace/1"


@dataclass(frozen=True)
class Span:
    """One thing that took time. ``bucket`` and ``nbytes`` are set for bucket spans."""

    name: str
    kind: str
    start_ms: float
    end_ms: float
    bucket: int | None = None
    nbytes: int | None = None

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.start_ms

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "start_ms": self.start_ms,
            "end_ms": self.end_ms,
            "bucket": self.bucket,
            "nbytes": self.nbytes,
        }


@dataclass
class StepTrace:
    """A step's spans, its buckets and (derived) metrics. See ``to_dict`` for the format."""

    rank: int
    world_size: int
    backend: str
    device: str
    clock: str
    step: int
    spans: list[Span]
    buckets: list[Bucket] = field(default_factory=list)
    origin_ms: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.buckets = [Bucket.from_dict(b) for b in self.buckets]
        if self.clock not in CLOCKS:
            raise ValueError(f"clock must be one of {CLOCKS}, got {self.clock!r}")
        for span in self.spans:
            if span.kind not in KINDS:
                raise ValueError(f"span {span.name!r} has unknown kind {span.kind!r}")

    @cached_property
    def metrics(self) -> StepMetrics:
        return step_metrics(self.spans)

    @property
    def simulated(self) -> bool:
        return self.clock == "simulated"

    def of(self, kind: str) -> list[Span]:
        """The spans of one kind, in time order."""
        return sorted((s for s in self.spans if s.kind == kind), key=lambda s: s.start_ms)

    # -- serialisation ---------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: rank, world_size, backend, device, clock, step, spans, buckets, metrics."""
        return {
            "format": FORMAT,
            "rank": self.rank,
            "world_size": self.world_size,
            "backend": self.backend,
            "device": self.device,
            "clock": self.clock,
            "step": self.step,
            "origin_ms": self.origin_ms,
            "spans": [s.to_dict() for s in self.spans],
            "buckets": [b.to_dict() for b in self.buckets],
            "metrics": self.metrics.to_dict(),
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, d: Any) -> StepTrace:
        """Read ``to_dict``'s output back; anything else is a clear error (metrics recomputed)."""
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            found = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise ValueError(
                f"not a dplab step trace (expected format {FORMAT!r}, found {found!r})"
            )
        missing = [
            k
            for k in ("rank", "world_size", "backend", "device", "clock", "step", "spans")
            if k not in d
        ]
        if missing:
            raise ValueError(f"step trace is missing {', '.join(missing)}")
        try:
            spans = [
                Span(
                    str(s["name"]),
                    str(s["kind"]),
                    float(s["start_ms"]),
                    float(s["end_ms"]),
                    s.get("bucket"),
                    s.get("nbytes"),
                )
                for s in d["spans"]
            ]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"step trace has a malformed span: {e!r}") from e
        return cls(
            rank=int(d["rank"]),
            world_size=int(d["world_size"]),
            backend=str(d["backend"]),
            device=str(d["device"]),
            clock=str(d["clock"]),
            step=int(d["step"]),
            spans=spans,
            buckets=[Bucket.from_dict(b) for b in d.get("buckets", [])],
            origin_ms=float(d.get("origin_ms", 0.0)),
            meta=dict(d.get("meta", {})),
        )


def last_steps(per_rank: list[list[StepTrace]]) -> list[StepTrace]:
    """Each rank's last step (the one after warm-up settles), in rank order."""
    return [rank_steps[-1] for rank_steps in per_rank]


def lane(kind: str) -> str:
    """Which lane of a rank a span is drawn in: ``comm`` for collectives and bucket marks, else
    ``compute``."""
    return "comm" if kind in (*COMM_KINDS, "bucket_ready") else "compute"


def chrome_trace(steps: list[StepTrace]) -> dict[str, Any]:
    """Merge steps of any ranks into one trace: pid = rank, tid 0 = compute lane, 1 = comm lane."""
    if not steps:
        raise ValueError("no steps to export")
    events: list[dict[str, Any]] = []
    for rank in sorted({s.rank for s in steps}):
        events.append(
            {
                "name": "process_name",
                "ph": "M",
                "pid": rank,
                "tid": 0,
                "args": {"name": f"rank {rank}"},
            }
        )
        events.append(
            {
                "name": "process_sort_index",
                "ph": "M",
                "pid": rank,
                "tid": 0,
                "args": {"sort_index": rank},
            }
        )
        for tid, lane_name in ((0, "compute"), (1, "comm")):
            events.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": rank,
                    "tid": tid,
                    "args": {"name": lane_name},
                }
            )
    for step in steps:
        names = {b.index: list(b.param_names) for b in step.buckets}
        for span in step.spans:
            args: dict[str, Any] = {"step": step.step, "kind": span.kind}
            if span.bucket is not None:
                args.update(
                    bucket=span.bucket, bytes=span.nbytes, params=names.get(span.bucket, [])
                )
            event = {
                "name": span.name,
                "cat": span.kind,
                "pid": step.rank,
                "tid": int(lane(span.kind) == "comm"),
                "ts": (step.origin_ms + span.start_ms) * 1e3,
                "args": args,
            }
            if span.kind == "bucket_ready":
                event.update(ph="i", s="t")
            else:
                event.update(ph="X", dur=max(span.duration_ms, 0.0) * 1e3)
            events.append(event)
    first = steps[0]
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "distributedInfo": {
            "rank": first.rank if len({s.rank for s in steps}) == 1 else None,
            "ranks": sorted({s.rank for s in steps}),
            "world_size": first.world_size,
            "backend": first.backend,
        },
        "otherData": {"producer": "dplab", "clock": first.clock},
    }
