"""``simulate``: a DDP step predicted from a measured profile and a link, as a ``StepTrace``.

The step is laid out the way a measured one is (same span kinds and names, same bucket list,
same metrics), so every figure and widget takes either:

- ``forward`` from 0 to F, then ``backward`` (the profile's times);
- buckets exactly as :class:`dplab.DDP` cuts them (:func:`dplab.ddp.buckets.bucket_plan` over
  the profile's parameters in reverse registration order); a bucket is ready when its last
  gradient is (``bucket_ready``), and is launched, in bucket order, after the compute thread
  divides it by the world size (the profile's ``divide_ms_per_mib``);
- one communication lane, as NCCL's one stream: bucket b's ``allreduce`` starts at
  max(bucket b ready, bucket b−1's all-reduce done) and lasts the link's ring time for its
  bytes at this world size;
- ``wait`` from the end of backward until the last all-reduce is done, then ``optimizer``.

Every rank does the same work on the same schedule, so one rank's trace stands for all: the
world size only enters through the ring time, and 1,024 ranks cost the same as 2.

With a :class:`~dplab.sim.contention.Contention`, backward and an all-reduce that overlap slow
each other (backward loses speed, the all-reduce pays a busy machine's α and β), which is what
happens when the same CPU cores compute and move the bytes. Without one (the default) overlap
is free, as on a GPU whose copies and NICs work beside the compute.

The network is a :class:`~dplab.sim.link.Link` (one α-β ring: this machine's loopback, or the
flat-ring teaching presets) or a :class:`~dplab.sim.fabric.Fabric` (a GPU cluster timed by
NCCL's cost model, which picks ring, tree or NVLS per bucket size; its world size is its own).
With a Fabric, a Contention's compute slowdown applies but the all-reduce keeps its time: GPU
collectives have no α-β for a busy CPU to inflate.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from typing import Any

from dplab._checks import check_nonneg, check_nonneg_each, check_world_size
from dplab._units import MIB
from dplab.ddp.buckets import bucket_plan, check_cap_mb
from dplab.sim.contention import Contention
from dplab.sim.fabric import Fabric
from dplab.sim.link import Link
from dplab.sim.profile import BackwardProfile
from dplab.trace.bucket import Bucket
from dplab.trace.step import Span, StepTrace


def _check_inputs(profile: Any, link: Any, contention: Any) -> None:
    if not isinstance(profile, BackwardProfile):
        raise ValueError(f"profile must be a BackwardProfile, got {type(profile).__name__}")
    if not isinstance(link, (Link, Fabric)):
        raise ValueError(
            "link must be a dplab.sim.Link (or use dplab.sim.get_link(name)) and fabric a "
            f"dplab.sim.Fabric, got {link!r}"
        )
    if contention is not None and not isinstance(contention, Contention):
        raise ValueError(f"contention must be a Contention or None, got {contention!r}")


def _network(link: Link | None, fabric: Fabric | None, world_size: int | None) -> tuple[Any, int]:
    """The one network to time all-reduces on, and the world size: a Fabric's own, or the
    ``world_size`` a Link needs."""
    if (link is None) == (fabric is None):
        raise ValueError("give exactly one of link= (a Link) or fabric= (a Fabric)")
    if fabric is not None:
        if not isinstance(fabric, Fabric):
            raise ValueError(f"fabric must be a dplab.sim.Fabric, got {fabric!r}")
        if world_size is not None and world_size != fabric.world_size:
            raise ValueError(
                f"world_size {world_size!r} does not match the fabric {fabric.name!r} "
                f"({fabric.world_size} ranks); leave it out or use fabric.with_nodes(n)"
            )
        return fabric, fabric.world_size
    if world_size is None:
        raise ValueError("world_size is required with a link (a Fabric carries its own)")
    return link, check_world_size(world_size)


def plan_buckets(
    profile: BackwardProfile, *, bucket_cap_mb: float, first_bucket_cap_mb: float
) -> list[Bucket]:
    """The buckets dplab.DDP would build for the profiled model (equal to its ``ddp.buckets``)."""
    rows = profile.bucket_rows()
    plan = bucket_plan(rows, bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=first_bucket_cap_mb)
    return [
        Bucket(
            index=b,
            param_names=tuple(rows[j][0] for j in members),
            nbytes=sum(rows[j][2] for j in members),
            numel=sum(rows[j][1] for j in members),
        )
        for b, members in enumerate(plan)
    ]


def schedule(
    ready: Sequence[float],
    backward_ms: float,
    comm_ms: Sequence[float],
    *,
    busy_comm_ms: Sequence[float] | None = None,
    compute_slowdown: float = 0.0,
    prep_ms: Sequence[float] | None = None,
) -> tuple[list[float], list[float], list[float], float]:
    """Wall times, from backward's start, of each bucket's ready, all-reduce start and end, and
    of backward's end.

    ``ready[b]``: when bucket b's last gradient is in, in *compute* time (ms of backward work
    done). Buckets are launched in index order, each once it and every earlier bucket are
    ready (as dplab.DDP does); launching first costs ``prep_ms[b]`` of compute (DDP's division
    by the world size), then the all-reduce queues on the one lane. ``comm_ms[b]``: its time on
    a quiet machine; ``busy_comm_ms[b]`` (default: the same): its time beside running backward.
    While both run, backward progresses at ``1/(1+compute_slowdown)`` of its speed and the
    all-reduce at ``comm_ms/busy_comm_ms`` of its quiet speed. An event loop over the buckets:
    O(buckets), whatever the world size.
    """
    n = len(ready)
    busy = list(comm_ms if busy_comm_ms is None else busy_comm_ms)
    prep = [0.0] * n if prep_ms is None else list(prep_ms)
    _check_schedule(ready, backward_ms, comm_ms, busy, prep, compute_slowdown)
    marks, launches, total = _compute_events(ready, prep, backward_ms)
    return _run_events(marks, launches, total, comm_ms, busy, compute_slowdown, backward_ms)


def _check_schedule(
    ready: Sequence[float],
    backward_ms: float,
    comm_ms: Sequence[float],
    busy: list[float],
    prep: list[float],
    compute_slowdown: float,
) -> None:
    """Refuse what :func:`schedule` could not lay out: mismatched lengths, negative or
    overflowing times, a busy all-reduce faster than a quiet one."""
    n = len(ready)
    if len(busy) != n or len(prep) != n or len(comm_ms) != n:
        raise ValueError("ready, comm_ms, busy_comm_ms and prep_ms need one entry per bucket")
    for name, values in (("ready", ready), ("comm_ms", comm_ms), ("busy_comm_ms", busy)):
        check_nonneg_each(name, values, unit="ms")
    check_nonneg_each("prep_ms", prep, unit="ms")
    check_nonneg("backward_ms", backward_ms)
    check_nonneg("compute_slowdown", compute_slowdown)
    if any(q < c for q, c in zip(busy, comm_ms, strict=True)):
        raise ValueError("busy_comm_ms must be >= comm_ms (being busy never speeds comm up)")
    # Every time adds to the wall clock; a sum that overflows to inf would never let the loop
    # below finish (inf - inf is nan), so an overflowing step is refused up front.
    slowest = (1.0 + compute_slowdown) * (max(backward_ms, *ready, 0.0) + sum(prep)) + sum(busy)
    if not math.isfinite(slowest):
        raise ValueError(
            "the step's times overflow (backward, divisions and all-reduces add up to more than "
            f"{_FLOAT_MAX:.3g} ms): check the link or profile numbers"
        )


def _compute_events(
    ready: Sequence[float], prep: list[float], backward_ms: float
) -> tuple[list[float], list[float], float]:
    """Each bucket's ready mark and launch in compute time, and backward's total compute.

    The division work is laid into the compute timeline: at launch point L_b (when b and all
    earlier buckets are ready) the compute thread divides b, pushing later work back."""
    n = len(ready)
    launch_at = list(itertools.accumulate(ready, max))
    # launch_at never decreases, so "divisions done before time t" is a prefix of prep
    done_prep = [0.0, *itertools.accumulate(prep)]
    marks = [r + done_prep[bisect.bisect_left(launch_at, r)] for r in ready]
    launches = [launch_at[b] + done_prep[b + 1] for b in range(n)]
    total = max(backward_ms, max(ready, default=0.0)) + sum(prep)
    return marks, launches, total


def _run_events(
    marks: list[float],
    launches: list[float],
    total: float,
    comm_ms: Sequence[float],
    busy: list[float],
    compute_slowdown: float,
    backward_ms: float,
) -> tuple[list[float], list[float], list[float], float]:
    """The event loop: compute and the one communication lane advance together, each at its
    rate while both run, until backward is done and the last all-reduce has ended."""
    n = len(marks)
    # events: (compute time, 0 = ready mark / 1 = launch, bucket); marks first on ties
    events = sorted(
        [(t, 0, b) for b, t in enumerate(marks)] + [(t, 1, b) for b, t in enumerate(launches)]
    )
    ready_wall: list[float] = [math.nan] * n
    launched: list[float] = [math.nan] * n
    starts: list[float] = [math.nan] * n
    ends: list[float] = [math.nan] * n
    wall = done = 0.0  # wall clock, and backward work done (compute ms)
    backward_end = math.nan if total > 0 else 0.0
    ev = nxt = 0  # next event; next bucket to start on the lane
    active, left = -1, 0.0  # bucket on the lane and its remaining quiet ms
    # Each pass ends compute, an all-reduce, or reaches an event; float rounding of a nearly
    # finished all-reduce can add a pass or two more. Past this many something is wrong.
    for _ in range(8 * (len(events) + n) + 16):
        while ev < len(events) and events[ev][0] <= done:
            _, kind, b = events[ev]
            (launched if kind else ready_wall)[b] = wall
            ev += 1
        while active < 0 and nxt < n and not math.isnan(launched[nxt]):
            starts[nxt] = wall
            if comm_ms[nxt] > 0:
                active, left = nxt, comm_ms[nxt]
            else:
                ends[nxt] = wall
            nxt += 1
        computing = done < total
        if not computing and active < 0:
            break
        both = computing and active >= 0
        rate_c = 1.0 / (1.0 + compute_slowdown) if both else 1.0
        rate_m = comm_ms[active] / busy[active] if both else 1.0
        target = min(events[ev][0], total) if ev < len(events) else total
        dt_c = (target - done) / rate_c if computing else math.inf
        dt_m = left / rate_m if active >= 0 else math.inf
        dt = min(dt_c, dt_m)
        wall += dt
        if computing:
            done = target if dt == dt_c else done + dt * rate_c
            if done >= total:
                backward_end = wall
        if active >= 0:
            if dt == dt_m:
                ends[active], active = wall, -1
            else:
                left -= dt * rate_m
                if left <= 0.0:  # rounding: what is left is below the clock's resolution
                    ends[active], active = wall, -1
    else:
        raise RuntimeError(
            f"the step schedule did not settle after {8 * (len(events) + n) + 16} events "
            f"(backward_ms={backward_ms!r}, comm_ms={list(comm_ms)!r}): please report it"
        )
    return ready_wall, starts, ends, backward_end


_FLOAT_MAX = 1.7976931348623157e308


def simulate(
    profile: BackwardProfile,
    *,
    bucket_cap_mb: float = 25.0,
    first_bucket_cap_mb: float = 1.0,
    world_size: int | None = None,
    link: Link | None = None,
    fabric: Fabric | None = None,
    contention: Contention | None = None,
) -> StepTrace:
    """One predicted DDP step of ``profile``'s model on ``world_size`` ranks over ``link``, or
    on ``fabric`` (its ranks; each bucket timed by ``fabric.allreduce_s``).

    ``contention``: pass ``profile.contention`` to predict a machine where communication and
    compute share cores (this CPU box); leave None for overlap at no cost.
    """
    net, n = _network(link, fabric, world_size)
    _check_inputs(profile, net, contention)
    buckets = plan_buckets(
        profile, bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=first_bucket_cap_mb
    )
    ready_of = {p.name: p.ready_ms for p in profile.params}
    ready = [max(ready_of[name] for name in b.param_names) for b in buckets]
    comm = [net.allreduce_s(b.nbytes, n) * 1e3 for b in buckets]
    _check_comm(comm, buckets, net, n)
    slow = contention or Contention()
    busy = (
        list(comm)
        if isinstance(net, Fabric)
        else [
            max(slow.busy_seconds(b.nbytes, n, net) * 1e3, c)
            for b, c in zip(buckets, comm, strict=True)
        ]
    )
    ready_wall, starts, ends, backward_end = schedule(
        ready,
        profile.backward_ms,
        comm,
        busy_comm_ms=busy,
        compute_slowdown=slow.compute_slowdown,
        prep_ms=[profile.divide_ms_per_mib * b.nbytes / MIB for b in buckets],
    )
    spans = _step_spans(profile, buckets, ready_wall, starts, ends, backward_end)
    return StepTrace(
        rank=0,
        world_size=n,
        backend="simulated",
        device=str(profile.meta.get("device", "cpu")),
        clock="simulated",
        step=0,
        spans=sorted(spans, key=lambda s: (s.start_ms, s.end_ms)),
        buckets=buckets,
        meta={
            "model": profile.model,
            "variant": "bucketed",
            "bucket_cap_mb": bucket_cap_mb,
            "first_bucket_cap_mb": first_bucket_cap_mb,
            "batch_size": profile.meta.get("batch_size"),
            "micro_batches": 1,
            "link": net.name,
            "link_detail": net.to_dict(),
            "fabric": isinstance(net, Fabric),
            "contention": slow.to_dict() if contention else None,
            "comm_lanes": 1,
            "profile": {
                k: profile.meta.get(k) for k in ("date", "command", "world_size", "backend")
            },
        },
    )


def _step_spans(
    profile: BackwardProfile,
    buckets: list[Bucket],
    ready_wall: list[float],
    starts: list[float],
    ends: list[float],
    backward_end: float,
) -> list[Span]:
    """The scheduled times as a step's spans: forward, backward, each bucket's ready mark and
    all-reduce, the wait for the last one, the optimizer."""
    f = profile.forward_ms
    spans = [Span("forward", "forward", 0.0, f), Span("backward", "backward", f, f + backward_end)]
    for b, bucket in enumerate(buckets):
        t = f + ready_wall[b]
        spans.append(Span(f"bucket {b} ready", "bucket_ready", t, t, b, bucket.nbytes))
        start, end = f + starts[b], f + ends[b]
        spans.append(Span(f"all-reduce bucket {b}", "allreduce", start, end, b, bucket.nbytes))
    wait_start = f + backward_end
    wait_end = max(wait_start, f + max(ends, default=0.0))
    spans.append(Span("wait", "wait", wait_start, wait_end))
    spans.append(Span("optimizer", "optimizer", wait_end, wait_end + profile.optimizer_ms))
    return spans


def _check_comm(comm: list[float], buckets: list[Bucket], net: Any, n: int) -> None:
    """An all-reduce the network cannot time in finite ms is the network's numbers' fault:
    say which bucket and which link, before the schedule is asked to add infinities."""
    total = math.fsum(comm) if all(math.isfinite(c) for c in comm) else math.inf
    if math.isfinite(total):
        return
    b = next((i for i, c in enumerate(comm) if not math.isfinite(c)), len(comm) - 1)
    numbers = (
        f" (alpha_s={net.alpha_s!r} s, bandwidth_Bps={net.bandwidth_Bps!r} B/s)"
        if isinstance(net, Link)
        else ""
    )
    raise ValueError(
        f"the all-reduces on {net.name!r}{numbers} at world size {n:,} take longer than a float "
        f"can hold (bucket {b}, {buckets[b].nbytes:,} bytes: {comm[b]!r} ms; all buckets: "
        f"{total!r} ms): the link's alpha or bandwidth is out of any real range"
    )


# Candidate caps: the E12 series (1, 1.2, 1.5, 1.8, 2.2, ...), round numbers about 20% apart.
E12 = (1.0, 1.2, 1.5, 1.8, 2.2, 2.7, 3.3, 3.9, 4.7, 5.6, 6.8, 8.2)


def candidate_caps(profile: BackwardProfile, *, low_mb: float = 0.01) -> list[float]:
    """E12 caps from ``low_mb`` up to the first one that holds every gradient in one bucket."""
    low_mb = check_cap_mb("low_mb", low_mb)  # log10 of 0 or less is a math domain error
    if int(low_mb * MIB) < 1:
        raise ValueError(
            f"low_mb={low_mb!r} is {int(low_mb * MIB)} bytes: a bucket cap must be at least "
            f"1 byte ({1 / MIB:.3g} MiB)"
        )
    top = profile.total_bytes / MIB
    caps: list[float] = []
    decade = 10.0 ** math.floor(math.log10(low_mb))
    while not caps or caps[-1] < top:
        for m in E12:
            cap = round(m * decade, 10)
            if cap >= low_mb and (not caps or caps[-1] < top):
                caps.append(cap)
        decade *= 10
    return caps


def sweep(
    profile: BackwardProfile,
    caps: Sequence[float],
    *,
    world_size: int | None = None,
    link: Link | None = None,
    fabric: Fabric | None = None,
    first_bucket_cap_mb: float = 1.0,
    contention: Contention | None = None,
) -> list[StepTrace]:
    """One simulated step per bucket cap in ``caps``."""
    return [
        simulate(
            profile,
            bucket_cap_mb=cap,
            first_bucket_cap_mb=first_bucket_cap_mb,
            world_size=world_size,
            link=link,
            fabric=fabric,
            contention=contention,
        )
        for cap in caps
    ]


def best_bucket_cap(
    profile: BackwardProfile,
    *,
    world_size: int | None = None,
    link: Link | None = None,
    fabric: Fabric | None = None,
    first_bucket_cap_mb: float = 1.0,
    contention: Contention | None = None,
    caps: Sequence[float] | None = None,
) -> float:
    """The bucket cap (MiB) with the shortest predicted step.

    Caps are tried from :func:`candidate_caps` (or ``caps``). The predicted step only changes
    where the bucket plan does, so neighbouring caps often tie; what is returned is the middle
    of the widest run of tied caps, furthest from the edges where a slightly different model
    would cut different buckets.
    """
    net, _ = _network(link, fabric, world_size)
    _check_inputs(profile, net, contention)
    given = candidate_caps(profile) if caps is None else caps
    tried = sorted({check_cap_mb("caps", c) for c in given})
    if not tried:
        raise ValueError("caps is empty: nothing to choose from")
    steps = [
        t.metrics.t_step_ms
        for t in sweep(
            profile,
            tried,
            world_size=world_size,
            link=link,
            fabric=fabric,
            first_bucket_cap_mb=first_bucket_cap_mb,
            contention=contention,
        )
    ]
    best = min(steps)
    runs: list[list[float]] = []  # runs of neighbouring caps that all reach the best step
    for i, (cap, step) in enumerate(zip(tried, steps, strict=True)):
        if step <= best * (1 + 1e-9):
            if runs and runs[-1][-1] == tried[i - 1]:
                runs[-1].append(cap)
            else:
                runs.append([cap])
    widest = max(runs, key=len)
    return widest[len(widest) // 2]
