"""The whole step of a user's job: where its time goes, how well its all-reduces run, a verdict.

The bucket cap only moves the communication left exposed after backward. Most slow jobs are
slow elsewhere (a data loader that cannot keep up, a host stall, compute), and a cap what-if
says nothing about that. So before any what-if the doctor splits each profiled step:

- the **step** is torch.profiler's own ``ProfilerStep#N`` range (from one ``prof.step()`` to the
  next), so the time spent fetching the next batch is in it;
- **data wait**: from the step's start to its first forward (the loader, host-to-device copies,
  anything the host does before the model runs);
- **forward**, **backward** (to the last gradient accumulated), **exposed communication** (from
  backward's end until the last bucket is reduced and copied back: torch's wait), **optimizer**;
- **other**: the rest of the step (a loss computed outside the module, ``zero_grad``, logging).

Per step the verdict is read on the rank whose backward ended last, as the exposure is (the
others' extra wait is skew); it names the largest term, and only when that is the exposed
communication is a bucket cap worth asking about.

The **overlap share** is Holistic Trace Analysis' (``CommunicationAnalysis.get_comm_comp_overlap``,
HTA 0.5): per rank, the time during which a communication and a computation run at once,
over the time communication runs, each merged into disjoint intervals first. HTA reads GPU
kernels (NCCL kernels against the rest); on a CPU trace the all-reduces (gloo's worker ranges)
are set against the training thread's forward, backward and optimizer.

**Achieved bandwidth** per all-reduce: nccl-tests' algbw = S/t and busbw = algbw·2(N−1)/N, with
t the transfer window (:func:`dplab.doctor.from_trace.collectives`), set against what a
reference link would give at that size (its α included): far below it is what a fallback to
sockets, or P2P switched off, looks like.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from dplab._units import MIB
from dplab.collectives.cost import algbw, busbw
from dplab.doctor.from_trace import by_step, collectives
from dplab.sim.link import Link
from dplab.trace.metrics import COMM_KINDS, length, subtract
from dplab.trace.step import StepTrace

TERMS = ("data wait", "forward", "backward", "exposed communication", "optimizer", "other")
COMPUTE_KINDS = ("forward", "backward", "optimizer")
WHAT_HELPS = {
    "data wait": "the step waits for its data: feed it faster (DataLoader workers, pinned "
    "memory, prefetching); a bucket cap will not help",
    "forward": "the step is compute-bound: a bucket cap will not help",
    "backward": "the step is compute-bound: a bucket cap will not help",
    "exposed communication": "the step waits for its all-reduces: the bucket-cap what-if "
    "below applies (and fewer all-reduces per sample: gradient accumulation under no_sync)",
    "optimizer": "the optimizer step dominates (a fused or foreach optimizer); a bucket cap "
    "will not help",
    "other": "host work outside the model and the optimizer (a loss outside the module, "
    "zero_grad, logging) dominates; a bucket cap will not help",
}


@dataclass(frozen=True)
class StepBudget:
    """One rank's profiled step, split into :data:`TERMS` (ms); they sum to ``step_ms``."""

    rank: int
    step: int
    step_ms: float
    data_wait_ms: float
    forward_ms: float
    backward_ms: float
    exposed_comm_ms: float
    optimizer_ms: float

    def terms(self) -> dict[str, float]:
        named = (
            self.data_wait_ms,
            self.forward_ms,
            self.backward_ms,
            self.exposed_comm_ms,
            self.optimizer_ms,
        )
        out = dict(zip(TERMS[:-1], named, strict=True))
        out["other"] = self.step_ms - sum(named)
        return out


def step_budget(trace: StepTrace) -> StepBudget:
    """Split one step. Its window is ``meta["profiler_step_ms"]`` (a torch.profiler trace);
    a step measured inside dplab has none and runs from its first span to its last."""
    window = trace.meta.get("profiler_step_ms")
    spans = trace.spans
    start, end = window if window else (min(s.start_ms for s in spans), trace.metrics.t_step_ms)
    forwards = trace.of("forward")
    first = min((s.start_ms for s in forwards), default=start)

    def total(kind: str) -> float:
        return sum(s.duration_ms for s in trace.of(kind))

    return StepBudget(
        rank=trace.rank,
        step=trace.step,
        step_ms=end - start,
        data_wait_ms=max(first - start, 0.0),
        forward_ms=total("forward"),
        backward_ms=total("backward"),
        exposed_comm_ms=total("wait"),
        optimizer_ms=total("optimizer"),
    )


def overlap_share(traces: Sequence[StepTrace]) -> float | None:
    """HTA's communication-computation overlap of one rank's steps (0 to 1; see the module
    notes), or None when no communication ran."""

    def spans(kinds: Sequence[str]) -> list[tuple[float, float]]:
        return [
            (t.origin_ms + s.start_ms, t.origin_ms + s.end_ms)
            for t in traces
            for s in t.spans
            if s.kind in kinds
        ]

    comm = spans(COMM_KINDS)
    total = length(comm)
    if total <= 0:
        return None
    return (total - length(subtract(comm, spans(COMPUTE_KINDS)))) / total


@dataclass(frozen=True)
class Achieved:
    """The all-reduces of one size: how many, their median transfer time, the bandwidths
    that gives (bytes/s), and the bus bandwidth the reference link would give at that size."""

    nbytes: int
    count: int
    seconds: float
    algbw_Bps: float
    busbw_Bps: float
    link_busbw_Bps: float

    @property
    def share_of_link(self) -> float:
        return self.busbw_Bps / self.link_busbw_Bps


def achieved_bandwidth(runs: Sequence[Sequence[StepTrace]], link: Link) -> list[Achieved]:
    """Per all-reduce size (smallest first): achieved algbw and busbw against ``link``'s."""
    n = runs[0][0].world_size
    sizes: dict[int, list[float]] = {}
    for c in collectives(runs):
        sizes.setdefault(c.wire_nbytes or c.nbytes, []).append(c.seconds)
    out = []
    for nbytes, times in sorted(sizes.items()):
        t = statistics.median(times)
        out.append(
            Achieved(
                nbytes=nbytes,
                count=len(times),
                seconds=t,
                algbw_Bps=algbw(nbytes, t),
                busbw_Bps=busbw(nbytes, t, n),
                link_busbw_Bps=busbw(nbytes, link.allreduce_s(nbytes, n), n),
            )
        )
    return out


def _medians(budgets: Sequence[StepBudget]) -> dict[str, float]:
    out = {t: statistics.median(b.terms()[t] for b in budgets) for t in TERMS}
    out["step"] = statistics.median(b.step_ms for b in budgets)
    return out


@dataclass(frozen=True)
class Budget:
    """The job's step budget: per rank (medians over the profiled steps), on the rank whose
    backward ended last (the one read for the verdict), each rank's overlap share, and the
    achieved bandwidth per all-reduce size."""

    per_rank: dict[int, dict[str, float]]
    last: dict[str, float]
    overlap: dict[int, float | None]
    bandwidth: list[Achieved]
    link: Link

    @property
    def largest(self) -> str:
        return max(TERMS, key=lambda t: self.last[t])

    @property
    def comms_bound(self) -> bool:
        return self.largest == "exposed communication"

    def verdict(self) -> str:
        term, step = self.largest, self.last["step"]
        ms = self.last[term]
        return (
            f"verdict: {term} is the largest part of the step ({ms:.2f} of {step:.2f} ms, "
            f"{ms / step:.0%}, on the rank whose backward ended last): {WHAT_HELPS[term]}"
        )

    def lines(self) -> list[str]:
        """The budget's part of the doctor's summary, the verdict last."""
        short = ("step", "data wait", "forward", "backward", "exposed", "optimizer", "other")
        head = "  rank   " + "   ".join(f"{t:>9}" for t in short) + "   overlap"
        out = ["step budget, ms (medians over the profiled steps):", head]
        for rank, row in [*self.per_rank.items(), ("last", self.last)]:
            share = self.overlap.get(rank) if isinstance(rank, int) else None
            cells = "   ".join(f"{row[t]:>9.2f}" for t in ("step", *TERMS))
            out.append(f"  {rank!s:>4}   {cells}   {'' if share is None else f'{share:7.0%}'}")
        out.append(
            "  (exposed: exposed communication; last: per step the rank whose backward ended "
            "last; overlap: HTA's, the share of communication time under computation)"
        )
        out.append(f"achieved bandwidth per all-reduce, against {self.link.name}:")
        for a in self.bandwidth:
            out.append(
                f"  {a.nbytes / MIB:8.3f} MiB x{a.count}: {a.seconds * 1e3:.3f} ms, algbw "
                f"{a.algbw_Bps / 1e9:.3g} GB/s, busbw {a.busbw_Bps / 1e9:.3g} GB/s "
                f"({a.share_of_link:.0%} of the link's {a.link_busbw_Bps / 1e9:.3g} GB/s)"
            )
        return [*out, self.verdict()]


def step_budgets(runs: Sequence[Sequence[StepTrace]], link: Link) -> Budget:
    """The :class:`Budget` of a job's profiled steps (``runs``: per rank, its steps)."""
    table = by_step(runs)
    per_rank: dict[int, list[StepBudget]] = {}
    last = []
    for traces in table.values():
        for t in traces:
            per_rank.setdefault(t.rank, []).append(step_budget(t))
        slow = max(traces, key=lambda t: t.origin_ms + t.of("backward")[-1].end_ms)
        last.append(step_budget(slow))
    return Budget(
        per_rank={r: _medians(b) for r, b in sorted(per_rank.items())},
        last=_medians(last),
        overlap={r[0].rank: overlap_share(r) for r in runs},
        bandwidth=achieved_bandwidth(runs, link),
        link=link,
    )
