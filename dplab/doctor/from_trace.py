"""A torch DDP job as its torch.profiler trace shows it, in the simulator's terms.

:func:`dplab.doctor.doctor.diagnose` is built on these; each is usable on its own:

- :func:`profile_from_trace`: the job's compute as a :class:`~dplab.sim.BackwardProfile` (a
  gradient is ready when its accumulation ends, just before torch's reducer copies it into its
  bucket; per step the slowest rank per gradient);
- :func:`collectives`: every all-reduce timed from its last rank's start to the first end (so
  skew is not transfer), **busy** when some rank's backward was still computing at its start,
  else **quiet**; :func:`job_link`: the ring model fitted to the quiet ones
  (:func:`fit_link`) and the busy ones' slowdown beside compute (:func:`fit_contention`);
- :func:`measured_steps`: each step's exposure, read on the rank whose backward ended last;
- :func:`simulate_lanes`: the simulator's step with gloo's two communication threads.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dplab.sim.contention import Contention
from dplab.sim.engine import plan_buckets, schedule, simulate
from dplab.sim.link import PRESETS, Link, loopback_link
from dplab.sim.profile import BackwardProfile, profile_from_ranks
from dplab.trace.bucket import Bucket
from dplab.trace.step import Span, StepTrace

MEDIAN_SE = 1.2533  # the standard error of a median of m normal samples is 1.2533·σ/√m
MAD_SIGMA = 1.4826  # σ of a normal spread from its median absolute deviation


# -- the trace as a profile --------------------------------------------------------------------


def _common_steps(runs: Sequence[Sequence[StepTrace]]) -> list[int]:
    if not runs or not all(runs):
        raise ValueError("no profiled steps to diagnose")
    common = set.intersection(*({s.step for s in rank} for rank in runs))
    if not common:
        raise ValueError("the ranks' traces share no ProfilerStep number")
    return sorted(common)


def by_step(runs: Sequence[Sequence[StepTrace]]) -> dict[int, list[StepTrace]]:
    steps = _common_steps(runs)
    table = {n: [] for n in steps}
    for rank in runs:
        for s in rank:
            if s.step in table:
                table[s.step].append(s)
    return table


def _sample(trace: StepTrace) -> dict[str, Any]:
    """One rank's step in the shape :func:`dplab.sim.profile_from_ranks` takes."""
    grads = trace.meta.get("grads") or []
    if not grads or any(g.get("nbytes") is None for g in grads):
        raise ValueError(
            f"rank {trace.rank}, step {trace.step}: gradient sizes were not recorded (profile "
            "with record_shapes=True, so that each reducer::mul_out carries its gradient's shape)"
        )
    backward = trace.of("backward")[-1]
    optimizer = trace.of("optimizer")
    return {
        "forward_ms": backward.start_ms,
        "backward_start_ms": backward.start_ms,
        "backward_ms": backward.duration_ms,
        "optimizer_ms": optimizer[-1].duration_ms if optimizer else 0.0,
        # registration order is taken as the reverse of the ready order, so that the simulator
        # (which buckets in reverse registration order) walks the gradients as they came
        "ready_ms": [g["ready_ms"] for g in reversed(grads)],
    }


def _params(trace: StepTrace) -> list[dict[str, Any]]:
    """The gradients as profile parameters, in (taken) registration order: reverse ready order."""
    grads = trace.meta["grads"]
    # buckets list their gradients in ready order, bucket 0 first
    members = [n for b in trace.buckets for n in b.param_names]
    names = members if len(members) == len(grads) else [f"grad {k}" for k in range(len(grads))]
    return [
        {
            "name": names[k],
            "numel": int(grads[k]["numel"]),
            "nbytes": int(grads[k]["nbytes"]),
            "dtype": str(grads[k]["dtype"]),
        }
        for k in reversed(range(len(grads)))
    ]


def profile_from_trace(
    runs: Sequence[Sequence[StepTrace]], *, steps: Sequence[int] | None = None, model: str = "job"
) -> BackwardProfile:
    """The job's compute as a :class:`BackwardProfile`: per step the slowest rank per gradient,
    then medians over steps (``steps``: which ProfilerStep numbers; default all common ones)."""
    table = by_step(runs)
    chosen = list(table) if steps is None else [n for n in steps if n in table]
    if not chosen:
        raise ValueError(f"none of the steps {list(steps or [])} is in the trace ({list(table)})")
    first = table[chosen[0]][0]
    params = _params(first)
    shape = [(p["numel"], p["dtype"]) for p in params]
    results = []
    for r in range(len(table[chosen[0]])):
        samples = []
        for n in chosen:
            trace = table[n][r]
            if [(p["numel"], p["dtype"]) for p in _params(trace)] != shape:
                raise ValueError(
                    f"rank {trace.rank}, step {n}: its gradients differ (in number, size or "
                    f"order) from rank {first.rank}, step {first.step}'s: not one static model"
                )
            samples.append(_sample(trace))
        results.append(
            {
                "params": params,
                "samples": samples,
                # torch divides while copying each gradient into its bucket (reducer::mul_out):
                # that cost is already inside the measured backward
                "divide_ms_per_mib": [0.0],
                "world_size": first.world_size,
                "backend": first.backend,
                "device": first.device,
            }
        )
    return profile_from_ranks(
        model,
        results,
        meta={"source": "torch.profiler trace", "steps": chosen, "ranks": len(results)},
    )


# -- the job's own link ------------------------------------------------------------------------


@dataclass(frozen=True)
class Collective:
    """One all-reduce as the ranks saw it: its bucket's gradient bytes, its transfer time (last
    rank's start to the first end), and whether some rank's backward was still computing when
    it began. ``wire_nbytes``: what it sent, fewer than ``nbytes`` when a comm hook compresses
    (bf16: half); the link is fitted per gradient byte, so the what-if keeps the hook."""

    step: int
    bucket: int
    nbytes: int
    seconds: float
    busy: bool
    wire_nbytes: int | None = None


def grad_bytes(trace: StepTrace, bucket: int, sent: int | None) -> int | None:
    """Bucket ``bucket``'s gradient bytes (the trace's ``bucket_grad_bytes``), else ``sent``."""
    held = trace.meta.get("bucket_grad_bytes") or []
    return int(held[bucket]) if bucket < len(held) and held[bucket] is not None else sent


def _backward_end(trace: StepTrace) -> float:
    return trace.origin_ms + trace.of("backward")[-1].end_ms


def collectives(runs: Sequence[Sequence[StepTrace]]) -> list[Collective]:
    """Every all-reduce seen on every rank with a known size, timed without the ranks' skew.

    Before the last rank joins, nobody's bytes move; after the first rank is done, the others
    only wait to learn it. So that window is the transfer itself.
    """
    out = []
    for number, traces in by_step(runs).items():
        computing_until = max(_backward_end(t) for t in traces)
        per_bucket: dict[int, list[tuple[float, float, int | None]]] = {}
        for t in traces:
            for s in t.of("allreduce"):
                per_bucket.setdefault(s.bucket, []).append(
                    (t.origin_ms + s.start_ms, t.origin_ms + s.end_ms, s.nbytes)
                )
        for bucket, spans in sorted(per_bucket.items()):
            if len(spans) != len(traces) or spans[0][2] is None:
                continue
            start = max(a for a, _, _ in spans)
            seconds = (min(e for _, e, _ in spans) - start) / 1e3
            if seconds > 0:
                busy = start < computing_until
                sent = int(spans[0][2])
                held = grad_bytes(traces[0], bucket, sent) or sent
                out.append(Collective(number, bucket, held, seconds, busy, sent))
    return out


def service_times(runs: Sequence[Sequence[StepTrace]]) -> list[Collective]:
    """Each all-reduce's cost as the rank whose backward ended last paid it.

    That rank is the one whose exposure is read, and the last to join every collective, so it
    never waits for a peer: from the moment its all-reduce could begin (its launch, or the end
    of the one before it on the same gloo thread, whichever is later) to its end is what the
    all-reduce cost it, thread wake-ups on a busy machine included, which the transfer window
    of :func:`collectives` leaves out. Busy when some backward was computing at that moment.
    """
    out = []
    for number, traces in by_step(runs).items():
        late = max(traces, key=_backward_end)
        computing_until = _backward_end(late) - late.origin_ms
        lanes = max(int(late.meta.get("comm_lanes", 1)), 1)
        launches = late.meta.get("launch_ms") or []
        spans = sorted(late.of("allreduce"), key=lambda s: s.bucket)
        for k, s in enumerate(spans):
            launch = launches[s.bucket] if s.bucket < len(launches) else None
            if launch is None or s.nbytes is None:
                continue
            begin = max(launch, spans[k - lanes].end_ms if k >= lanes else launch)
            if s.end_ms > begin:
                seconds = (s.end_ms - begin) / 1e3
                held = grad_bytes(late, s.bucket, s.nbytes) or s.nbytes
                busy = begin < computing_until
                out.append(Collective(number, s.bucket, held, seconds, busy, s.nbytes))
    return out


def collective_samples(runs: Sequence[Sequence[StepTrace]]) -> list[tuple[int, float]]:
    """(bytes, seconds) per all-reduce (see :func:`collectives`)."""
    return [(c.nbytes, c.seconds) for c in collectives(runs)]


def prior_link(backend: str) -> Link:
    """The shape of the cost to assume when a trace cannot tell α from β: on gloo, this
    machine's measured loopback fit (if the bandwidth bench has run), else NCCL's NVLink
    preset (its α from NCCL's own tuning table)."""
    if backend == "gloo":
        try:
            return loopback_link()
        except (FileNotFoundError, ValueError):
            pass
    return PRESETS["nvlink-h100"]


def fit_link(
    runs: Sequence[Sequence[StepTrace]],
    *,
    prior: Link | None = None,
    samples: Sequence[tuple[int, float]] | None = None,
) -> Link:
    """α and β of the ring model, fitted to the trace's own all-reduces by least squares.

    ``samples``: the (bytes, seconds) to fit (default: every all-reduce of the trace). When the
    buckets are all about one size (less than 1.5× apart), the per-message latency α and the
    per-byte cost β cannot be told apart (and α = 0 would make ever smaller buckets look free).
    Then the cost keeps the shape of a ``prior`` link (default :func:`prior_link`): its α and β
    are scaled by one factor, the median ratio of the trace's times to the prior's, so the
    what-if costs this job's all-reduces as measured.
    """
    samples = collective_samples(runs) if samples is None else list(samples)
    n = runs[0][0].world_size
    if n < 2:
        raise ValueError("a world size of 1 has no all-reduce cost to fit")
    if not samples:
        raise ValueError(
            "no all-reduce was seen on every rank with a known size: cannot fit the link "
            "(pass every rank's trace, recorded with record_shapes=True)"
        )
    c = 2.0 * (n - 1)
    xs = [2.0 * (n - 1) / n * b for b, _ in samples]
    ts = [t for _, t in samples]
    backend = runs[0][0].backend
    how = f"fitted to {len(samples)} all-reduces of this trace ({n} ranks, {backend})"
    alpha = beta = -1.0
    if prior is None and max(xs) >= 1.5 * min(xs) and len(samples) >= 3:
        k = len(xs)
        sx, st = sum(xs), sum(ts)
        sxx, sxt = sum(x * x for x in xs), sum(x * t for x, t in zip(xs, ts, strict=True))
        beta = (k * sxt - sx * st) / (k * sxx - sx * sx)
        alpha = (st - beta * sx) / k / c
    if alpha <= 0 or beta <= 0:
        shape = prior or prior_link(backend)
        scale = statistics.median(
            t / shape.allreduce_s(b, n) for b, t in samples if shape.allreduce_s(b, n) > 0
        )
        alpha, beta = shape.alpha_s * scale, shape.beta_s_per_byte * scale
        how += (
            f"; the buckets are all one size, so α:β is {shape.name}'s, scaled by "
            f"{scale:.3g} to this trace ({shape.source})"
        )
    return Link.from_beta("this job (fitted)", alpha, beta, how)


def fit_contention(found: Sequence[Collective], link: Link, world_size: int) -> Contention:
    """How much slower an all-reduce runs while backward computes beside it, from the trace.

    The busy all-reduces' median ratio to ``link`` (fitted to the quiet ones), on α and β alike
    (one ratio: the sizes of the busy buckets rarely tell the two apart). At least 1: running
    beside compute never speeds communication up. Backward's own slowdown is left at 0: the
    trace's compute times were measured with the all-reduces beside them already.
    """
    ratios = [
        c.seconds / link.allreduce_s(c.nbytes, world_size)
        for c in found
        if c.busy and link.allreduce_s(c.nbytes, world_size) > 0
    ]
    factor = max(statistics.median(ratios), 1.0) if ratios else 1.0
    quiet = sum(not c.busy for c in found)
    return Contention(
        alpha_factor=factor,
        beta_factor=factor,
        probe={"source": "this trace", "busy": len(ratios), "quiet": quiet},
    )


def job_link(
    runs: Sequence[Sequence[StepTrace]], *, prior: Link | None = None
) -> tuple[Link, Contention]:
    """The job's quiet link and its contention, both from the trace (see the module notes)."""
    found = service_times(runs) or collectives(runs)
    quiet = [(c.nbytes, c.seconds) for c in found if not c.busy]
    link = fit_link(runs, prior=prior, samples=quiet or [(c.nbytes, c.seconds) for c in found])
    if not quiet:
        # nothing ran alone: the link is the busy one already, and there is no ratio to take
        return link, Contention(probe={"source": "this trace", "busy": len(found), "quiet": 0})
    return link, fit_contention(found, link, runs[0][0].world_size)


def job_links(
    runs: Sequence[Sequence[StepTrace]], *, prior: Link | None = None
) -> list[tuple[Link, Contention]]:
    """:func:`job_link`, and when the trace cannot split α from β, a second, all-latency link.

    With every quiet all-reduce of one size (torch's default cap leaves one exposed bucket),
    the trace gives one cost at one size: how it splits into per-message latency and per-byte
    cost is the prior's guess. At a much smaller cap that guess decides the prediction, and on
    a loaded CPU box the latency (a gloo thread waiting for a core at every message) can be
    nearly all of it. So the other bound is a link whose cost is all per message (β a
    thousandth of the first link's): the truth lies between the two, and the doctor's
    interval spans both.
    """
    first = job_link(runs, prior=prior)
    found = service_times(runs) or collectives(runs)
    quiet = [(c.nbytes, c.seconds) for c in found if not c.busy]
    sizes = [b for b, _ in quiet]
    if not quiet or (max(sizes) >= 1.5 * min(sizes) and len(quiet) >= 3):
        return [first]
    n = runs[0][0].world_size
    link = first[0]
    tiny = link.beta_s_per_byte * 1e-3
    alpha = statistics.median(max(t - b * tiny * 2 * (n - 1) / n, 0.0) for b, t in quiet)
    latency = Link.from_beta(
        "this job (fitted, all latency)",
        alpha / (2 * (n - 1)),
        tiny,
        f"the other bound: the same {len(quiet)} quiet all-reduces, cost all per message",
    )
    return [first, (latency, fit_contention(found, latency, n))]


# -- what was measured -------------------------------------------------------------------------


@dataclass(frozen=True)
class StepRow:
    """One profiled step as measured, read on the rank whose backward ended last."""

    step: int
    rank: int
    t_step_ms: float  # the slowest rank's
    backward_ms: float
    comm_ms: float
    exposed_ms: float
    exposed_by_rank: tuple[float, ...]


@dataclass(frozen=True)
class BucketRow:
    """One bucket of the job: its size, its gradients and its exposure (median over steps)."""

    index: int
    nbytes: int
    n_params: int
    exposed_ms: float


def _last_backward(traces: Sequence[StepTrace]) -> StepTrace:
    return max(traces, key=_backward_end)


def measured_steps(runs: Sequence[Sequence[StepTrace]]) -> list[StepRow]:
    """Each profiled step's exposure, read on the rank whose backward ended last."""
    rows = []
    for number, traces in by_step(runs).items():
        slow = _last_backward(traces)
        m = slow.metrics
        rows.append(
            StepRow(
                step=number,
                rank=slow.rank,
                t_step_ms=max(t.metrics.t_step_ms for t in traces),
                backward_ms=m.t_backward_ms,
                comm_ms=m.t_comm_ms,
                exposed_ms=m.exposed_comm_ms,
                exposed_by_rank=tuple(t.metrics.exposed_comm_ms for t in traces),
            )
        )
    return rows


def bucket_rows(runs: Sequence[Sequence[StepTrace]]) -> list[BucketRow]:
    table = by_step(runs)
    exposed: dict[int, list[float]] = {}
    for traces in table.values():
        for b, ms in _last_backward(traces).metrics.exposed_ms.items():
            exposed.setdefault(b, []).append(ms)
    last = table[max(table)][0]
    return [
        BucketRow(
            b.index, b.nbytes, len(b.param_names), statistics.median(exposed.get(b.index, [0.0]))
        )
        for b in sorted(last.buckets, key=lambda b: b.index)
    ]


def simulate_lanes(
    profile: BackwardProfile,
    *,
    bucket_cap_mb: float,
    first_bucket_cap_mb: float,
    world_size: int,
    link: Link,
    contention: Contention | None = None,
    lanes: int = 1,
) -> StepTrace:
    """:func:`dplab.sim.simulate` with ``lanes`` communication threads instead of one.

    Gloo runs its collectives on a pool of worker threads (two by default): a bucket that is
    launched while one all-reduce is in flight starts at once on the other thread, so the
    tail behind backward is half as long as one lane would make it. Buckets go to the lanes in
    turn (the queue is first in, first out and the threads alike). Backward's own slowdown is
    not modelled here (the trace's compute already ran beside the all-reduces), so each lane is
    one independent schedule of its buckets over the same backward.
    """
    if lanes <= 1:
        return simulate(
            profile,
            bucket_cap_mb=bucket_cap_mb,
            first_bucket_cap_mb=first_bucket_cap_mb,
            world_size=world_size,
            link=link,
            contention=contention,
        )
    slow = contention or Contention()
    plan = plan_buckets(
        profile, bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=first_bucket_cap_mb
    )
    ready_of = {p.name: p.ready_ms for p in profile.params}
    ready = [max(ready_of[name] for name in b.param_names) for b in plan]
    quiet = [link.allreduce_s(b.nbytes, world_size) * 1e3 for b in plan]
    busy = [
        max(slow.busy_seconds(b.nbytes, world_size, link) * 1e3, q)
        for b, q in zip(plan, quiet, strict=True)
    ]
    starts, ends = [0.0] * len(plan), [0.0] * len(plan)
    backward_end = profile.backward_ms
    for lane in range(lanes):
        mine = list(range(lane, len(plan), lanes))
        if not mine:
            continue
        _, s, e, backward_end = schedule(
            [ready[b] for b in mine],
            profile.backward_ms,
            [quiet[b] for b in mine],
            busy_comm_ms=[busy[b] for b in mine],
        )
        for k, b in enumerate(mine):
            starts[b], ends[b] = s[k], e[k]
    spans = _lanes_spans(profile, plan, ready, starts, ends, backward_end)
    return StepTrace(
        rank=0,
        world_size=world_size,
        backend="simulated",
        device=str(profile.meta.get("device", "cpu")),
        clock="simulated",
        step=0,
        spans=sorted(spans, key=lambda s: (s.start_ms, s.end_ms)),
        buckets=plan,
        meta={
            "model": profile.model,
            "bucket_cap_mb": bucket_cap_mb,
            "first_bucket_cap_mb": first_bucket_cap_mb,
            "link": link.name,
            "contention": slow.to_dict(),
            "comm_lanes": lanes,
        },
    )


def _lanes_spans(
    profile: BackwardProfile,
    plan: list[Bucket],
    ready: list[float],
    starts: list[float],
    ends: list[float],
    backward_end: float,
) -> list[Span]:
    """The spans of :func:`simulate_lanes`' step, as :func:`dplab.sim.simulate` draws them."""
    f = profile.forward_ms
    spans = [Span("forward", "forward", 0.0, f), Span("backward", "backward", f, f + backward_end)]
    for b, bucket in enumerate(plan):
        t = f + min(ready[b], backward_end)
        spans.append(Span(f"bucket {b} ready", "bucket_ready", t, t, b, bucket.nbytes))
        spans.append(
            Span(
                f"all-reduce bucket {b}",
                "allreduce",
                f + starts[b],
                f + ends[b],
                b,
                bucket.nbytes,
            )
        )
    wait_end = f + max(backward_end, *ends)
    spans.append(Span("wait", "wait", f + backward_end, wait_end))
    spans.append(Span("optimizer", "optimizer", wait_end, wait_end + profile.optimizer_ms))
    return spans
