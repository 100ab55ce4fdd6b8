"""The bucket doctor: which buckets of *your* torch DDP job are exposed, and what cap would help.

It reads a torch.profiler trace (:func:`dplab.trace.profiler.from_profiler`), turns it into the
simulator's :class:`~dplab.sim.BackwardProfile` (a gradient is ready when its accumulation
ends, just before torch's reducer copies it into its bucket; the compute times are the trace's),
fits the job's own all-reduce cost to the trace's collectives, and asks
:func:`dplab.sim.simulate` what the step would look like at other caps.

How the numbers are read:

- a step's **exposure** is that of the rank whose backward ended last: the step cannot finish
  before that rank's gradients are reduced, and what a faster rank sees beyond it is waiting for
  the slower one (skew), which no bucket cap removes;
- the **link** is fitted to the trace's own all-reduces, each timed from the moment its last
  rank started it to the first end (so skew does not count as transfer time), by least squares
  on the ring model ``t = 2(N−1)·α + 2(N−1)/N·S·β``; when the buckets are all about one size
  the two terms cannot be told apart, and a prior link's α:β is scaled to the trace instead;
- the **uncertainty** is the spread of the prediction over the profiled steps (one profile per
  step, slowest rank per gradient), and the model's miss at the job's *own* cap (predicted vs
  measured exposure): a predicted gain smaller than both is not a reason to change the cap.

On CPU (gloo) the trace's all-reduces were timed while backward ran beside them, so the fitted
link is a busy machine's and overlap in the what-if is free; on GPU (NCCL) both are the usual
model. The simulator has one communication lane (NCCL's stream); gloo runs two threads.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dplab.sim import (
    PRESETS,
    BackwardProfile,
    Link,
    candidate_caps,
    get_link,
    loopback_link,
    plan_buckets,
    profile_from_ranks,
    simulate,
)
from dplab.trace import StepTrace
from dplab.trace.profiler import from_profiler

MIB = 1024 * 1024
TORCH_DEFAULT_CAP_MB = 25.0
TORCH_FIRST_BUCKET_MB = 1.0


def first_cap(cap_mb: float | None) -> float:
    """torch's first bucket for ``DistributedDataParallel(bucket_cap_mb=cap_mb)``.

    torch 2.13 (``_BucketCapacityConfig`` in torch/nn/parallel/distributed.py) gives the first
    bucket 1 MiB only when ``bucket_cap_mb`` is left at its default (None, meaning 25 MiB); a
    cap passed explicitly is the first bucket's cap too. Every cap the doctor recommends is one
    to pass explicitly.
    """
    return TORCH_FIRST_BUCKET_MB if cap_mb is None else cap_mb


# -- the trace as a profile --------------------------------------------------------------------


def _common_steps(runs: Sequence[Sequence[StepTrace]]) -> list[int]:
    if not runs or not all(runs):
        raise ValueError("no profiled steps to diagnose")
    common = set.intersection(*({s.step for s in rank} for rank in runs))
    if not common:
        raise ValueError("the ranks' traces share no ProfilerStep number")
    return sorted(common)


def _by_step(runs: Sequence[Sequence[StepTrace]]) -> dict[int, list[StepTrace]]:
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
    members = [n for b in trace.buckets for n in b.get("param_names", [])]
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
    table = _by_step(runs)
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


def collective_samples(runs: Sequence[Sequence[StepTrace]]) -> list[tuple[int, float]]:
    """(bytes, seconds) per all-reduce: from its last rank's start to the end it reached first.

    Before the last rank joins, nobody's bytes move; after the first rank is done, the others
    only wait to learn it. So that window is the transfer itself, without the ranks' skew.
    """
    out = []
    for traces in _by_step(runs).values():
        per_bucket: dict[int, list[tuple[float, float, int | None]]] = {}
        for t in traces:
            for s in t.of("allreduce"):
                per_bucket.setdefault(s.bucket, []).append(
                    (t.origin_ms + s.start_ms, t.origin_ms + s.end_ms, s.nbytes)
                )
        for spans in per_bucket.values():
            if len(spans) != len(traces) or spans[0][2] is None:
                continue
            seconds = (min(e for _, e, _ in spans) - max(a for a, _, _ in spans)) / 1e3
            if seconds > 0:
                out.append((int(spans[0][2]), seconds))
    return out


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


def fit_link(runs: Sequence[Sequence[StepTrace]], *, prior: Link | None = None) -> Link:
    """α and β of the ring model, fitted to the trace's own all-reduces by least squares.

    When the buckets are all about one size (less than 1.5× apart), the per-message latency α
    and the per-byte cost β cannot be told apart (and α = 0 would make ever smaller buckets
    look free). Then the cost keeps the shape of a ``prior`` link (default
    :func:`prior_link`): its α and β are scaled by one factor, the median ratio of the trace's
    times to the prior's, so the what-if costs this job's all-reduces as measured.
    """
    samples = collective_samples(runs)
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


# -- the current cap ---------------------------------------------------------------------------


def _sizes(trace: StepTrace) -> list[int | None]:
    return [b.get("nbytes") for b in sorted(trace.buckets, key=lambda b: b["index"])]


def _plan_sizes(profile: BackwardProfile, cap: float, first: float) -> list[int]:
    plan = plan_buckets(profile, bucket_cap_mb=cap, first_bucket_cap_mb=first)
    return [b["nbytes"] for b in plan]


def infer_cap(
    profile: BackwardProfile, observed: Sequence[int]
) -> tuple[float, float, tuple[float, float]]:
    """The job's bucket cap, from its buckets: the caps whose plan gives exactly those buckets.

    Returns (cap, first bucket's cap, the range of fitting caps tried): torch's default (25 MiB,
    first bucket 1 MiB) if it fits, else the largest fitting explicit cap (every cap in the
    range cuts the same buckets, so the what-if is the same for all of them).
    """
    if _plan_sizes(profile, TORCH_DEFAULT_CAP_MB, TORCH_FIRST_BUCKET_MB) == list(observed):
        return TORCH_DEFAULT_CAP_MB, TORCH_FIRST_BUCKET_MB, (TORCH_DEFAULT_CAP_MB,) * 2
    tried = sorted({round(s / MIB, 6) for s in observed if s} | set(candidate_caps(profile)))
    fits = [c for c in tried if _plan_sizes(profile, c, first_cap(c)) == list(observed)]
    if not fits:
        raise ValueError(
            f"no bucket cap reproduces this job's buckets ({list(observed)} bytes); "
            "pass the job's cap (current_cap_mb=, --current-cap-mb)"
        )
    return fits[-1], first_cap(fits[-1]), (fits[0], fits[-1])


# -- the diagnosis -----------------------------------------------------------------------------


@dataclass
class Spread:
    """A prediction over the profiled steps: median and the range."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(statistics.median(values), min(values), max(values))

    def __str__(self) -> str:
        lo, mid, hi = (round(x, 2) + 0.0 for x in (self.low, self.median, self.high))
        return f"{mid:.2f} ms (steps: {lo:.2f} to {hi:.2f})"


@dataclass
class Diagnosis:
    world_size: int
    backend: str
    steps: list[int]
    current_cap_mb: float
    current_first_cap_mb: float
    cap_source: str
    link: Link
    measured: list[dict[str, Any]]
    buckets: list[dict[str, Any]]
    predicted_current: Spread
    best_cap_mb: float
    predicted_best: Spread
    gain: Spread
    model_miss_ms: float
    recommend: bool
    sweep: list[dict[str, float]] = field(default_factory=list)
    simulated_best: StepTrace | None = None
    simulated_current: StepTrace | None = None

    @property
    def measured_exposed(self) -> Spread:
        return Spread.of([m["exposed_ms"] for m in self.measured])

    def recommendation(self) -> str:
        if not self.recommend:
            return (
                f"keep the cap ({self.current_cap_mb:.3g} MiB): the best cap tried, "
                f"{self.best_cap_mb:.3g} MiB, would gain {self.gain}, not more than the "
                f"uncertainty (the steps' spread, and the model's miss of "
                f"{self.model_miss_ms:.2f} ms at the current cap)"
            )
        return (
            f"with bucket_cap_mb={self.best_cap_mb:.3g} this job would expose "
            f"{self.predicted_best.median:.2f} ms instead of {self.predicted_current.median:.2f} "
            f"ms (measured: {self.measured_exposed.median:.2f} ms) per step: a gain of "
            f"{self.gain} ± {self.model_miss_ms:.2f} ms (the model's miss at the current cap)"
        )

    def summary(self) -> str:
        lines = [
            f"{self.world_size} ranks ({self.backend}), profiled steps {self.steps}, "
            f"bucket cap {self.current_cap_mb:.3g} MiB ({self.cap_source})",
            f"link: {self.link.describe()}  [{self.link.source}]",
            "",
            "per step (the rank whose backward ended last):",
            "  step   t_step ms   backward ms   comm ms   exposed ms   (exposed per rank)",
        ]
        for m in self.measured:
            per_rank = ", ".join(f"{x:.2f}" for x in m["exposed_by_rank"])
            lines.append(
                f"  {m['step']:>4}   {m['t_step_ms']:9.2f}   {m['backward_ms']:11.2f}   "
                f"{m['comm_ms']:7.2f}   {m['exposed_ms']:10.2f}   ({per_rank})"
            )
        lines += ["", "per bucket (medians over steps):", "  bucket   MiB     params   exposed ms"]
        for b in self.buckets:
            lines.append(
                f"  {b['index']:>6}   {b['nbytes'] / MIB:6.3f}   {b['n_params']:>6}   "
                f"{b['exposed_ms']:10.2f}"
            )
        lines += [
            "",
            f"predicted exposure at the current cap: {self.predicted_current}; measured: "
            f"{self.measured_exposed}",
            f"predicted exposure at {self.best_cap_mb:.3g} MiB: {self.predicted_best}",
            "",
            "recommendation: " + self.recommendation(),
        ]
        return "\n".join(lines)


def _last_backward(traces: Sequence[StepTrace]) -> StepTrace:
    return max(traces, key=lambda t: t.origin_ms + t.of("backward")[-1].end_ms)


def _simulate(
    profile: BackwardProfile, cap: float, n: int, link: Link, first: float | None = None
) -> StepTrace:
    return simulate(
        profile,
        bucket_cap_mb=cap,
        first_bucket_cap_mb=first_cap(cap) if first is None else first,
        world_size=n,
        link=link,
    )


def diagnose(
    source: Any,
    *,
    link: str | Link | None = None,
    prior: str | Link | None = None,
    current_cap_mb: float | None = None,
    ddp_logging_data: Mapping[str, Any] | None = None,
    caps: Sequence[float] | None = None,
) -> Diagnosis:
    """Read a torch DDP job's profiler trace (or ``from_profiler``'s output) and diagnose it.

    ``link``: a preset name or a :class:`Link` to ask "what if on that fabric"; default: the
    job's own, fitted to the trace (``prior``: the link whose α:β shape the fit keeps when the
    buckets are all one size; see :func:`fit_link`). ``current_cap_mb``: the job's cap, else
    read from ``ddp_logging_data['bucket_cap_bytes']``, else inferred from its buckets.
    """
    if isinstance(source, list) and source and all(isinstance(r, list) for r in source):
        runs = source
    else:
        runs = from_profiler(source, ddp_logging_data=ddp_logging_data)
    table = _by_step(runs)
    steps = list(table)
    profile = profile_from_trace(runs)
    n = runs[0][0].world_size
    the_link = (
        fit_link(runs, prior=get_link(prior) if prior else None) if link is None else get_link(link)
    )
    observed = [int(x) for x in _sizes(table[steps[-1]][0])]
    if current_cap_mb is not None or (ddp_logging_data or {}).get("bucket_cap_bytes"):
        if current_cap_mb is not None:
            cap, cap_source = float(current_cap_mb), "given"
        else:
            cap = int(ddp_logging_data["bucket_cap_bytes"]) / MIB
            cap_source = "from ddp._get_ddp_logging_data()"
        # torch's default cap has a 1 MiB first bucket; an explicit one does not
        first = next(
            (f for f in (cap, TORCH_FIRST_BUCKET_MB) if _plan_sizes(profile, cap, f) == observed),
            cap,
        )
    else:
        cap, first, (lo, hi) = infer_cap(profile, observed)
        cap_source = (
            "inferred: torch's default"
            if lo == hi == TORCH_DEFAULT_CAP_MB
            else f"inferred: every cap tried from {lo:.3g} to {hi:.3g} MiB gives these buckets"
        )
    tried = sorted(set(candidate_caps(profile) if caps is None else caps) | {cap})
    # one profile per step: the prediction is judged on every step, and chosen on the median
    per_step = [profile_from_trace(runs, steps=[number]) for number in steps]
    predicted: dict[float, list[StepTrace]] = {
        c: [_simulate(p, c, n, the_link, first if c == cap else None) for p in per_step]
        for c in tried
    }
    sweep = [
        {
            "cap_mb": c,
            "t_step_ms": statistics.median(t.metrics.t_step_ms for t in predicted[c]),
            "exposed_ms": statistics.median(t.metrics.exposed_comm_ms for t in predicted[c]),
        }
        for c in tried
    ]
    fastest = min(s["t_step_ms"] for s in sweep)
    # ties: the cap nearest the current one, i.e. the smallest change that reaches the best
    best = min(
        (s for s in sweep if s["t_step_ms"] <= fastest * (1 + 1e-9)),
        key=lambda s: abs(math.log(s["cap_mb"] / cap)),
    )["cap_mb"]
    per_step_current = [t.metrics.exposed_comm_ms for t in predicted[cap]]
    per_step_best = [t.metrics.exposed_comm_ms for t in predicted[best]]
    measured, exposed_by_bucket = [], {}
    for number in steps:
        traces = table[number]
        slow = _last_backward(traces)
        m = slow.metrics
        measured.append(
            {
                "step": number,
                "rank": slow.rank,
                "t_step_ms": max(t.metrics.t_step_ms for t in traces),
                "backward_ms": m.t_backward_ms,
                "comm_ms": m.t_comm_ms,
                "exposed_ms": m.exposed_comm_ms,
                "exposed_by_rank": [t.metrics.exposed_comm_ms for t in traces],
            }
        )
        for b, ms in m.exposed_ms.items():
            exposed_by_bucket.setdefault(b, []).append(ms)
    last = table[steps[-1]][0]
    buckets = [
        {
            "index": b["index"],
            "nbytes": b["nbytes"] or 0,
            "n_params": len(b.get("param_names", [])),
            "exposed_ms": statistics.median(exposed_by_bucket.get(b["index"], [0.0])),
        }
        for b in sorted(last.buckets, key=lambda b: b["index"])
    ]
    current = Spread.of(per_step_current)
    gain = Spread.of([c - b for c, b in zip(per_step_current, per_step_best, strict=True)])
    miss = abs(current.median - statistics.median(m["exposed_ms"] for m in measured))
    return Diagnosis(
        world_size=n,
        backend=runs[0][0].backend,
        steps=steps,
        current_cap_mb=cap,
        current_first_cap_mb=first,
        cap_source=cap_source,
        link=the_link,
        measured=measured,
        buckets=buckets,
        predicted_current=current,
        best_cap_mb=best,
        predicted_best=Spread.of(per_step_best),
        gain=gain,
        model_miss_ms=miss,
        recommend=best != cap and gain.low > 0 and gain.median > miss,
        sweep=sweep,
        simulated_best=_simulate(profile, best, n, the_link),
        simulated_current=_simulate(profile, cap, n, the_link, first),
    )
