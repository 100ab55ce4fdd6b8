"""The bucket doctor: which buckets of *your* torch DDP job are exposed, and what cap would help.

It reads a torch.profiler trace (:func:`dplab.trace.profiler.from_profiler`), turns it into the
simulator's :class:`~dplab.sim.BackwardProfile` (a gradient is ready when its accumulation
ends, just before torch's reducer copies it into its bucket; the compute times are the trace's),
fits the job's own all-reduce cost to the trace's collectives, and asks
:func:`dplab.sim.simulate` what the step would look like at other caps.

How the numbers are read (the trace-side pieces live in :mod:`dplab.doctor.from_trace` and
:mod:`dplab.doctor.straggler`):

- a step's **exposure** is that of the rank whose backward ended last: the step cannot finish
  before that rank's gradients are reduced, and what a faster rank sees beyond it is waiting for
  the slower one (skew), which no bucket cap removes. The rank that waits *least* is the
  **straggler** (:func:`find_straggler`): the others' extra wait is how far behind it is;
- each all-reduce costs what that last rank paid for it (:func:`service_times`: from when it
  could begin, its launch or the end of the one before it on the same gloo thread, to its end;
  thread wake-ups on a busy machine included), **quiet** when every backward had ended, **busy**
  when some backward was still computing. Where compute and communication share the CPU cores
  (gloo), a busy all-reduce waits for a core: its median ratio to the quiet link is the
  **contention** (:func:`fit_contention`), and the what-if runs each all-reduce at the busy cost
  while backward computes, on as many threads as the trace shows (gloo runs two);
- the **link** is fitted to the quiet all-reduces by least squares on the ring model
  ``t = 2(N−1)·α + 2(N−1)/N·S·β``. At torch's default cap the quiet ones are all one size (the
  last bucket), which cannot tell per-message latency from per-byte cost, and at a much
  smaller cap that split decides the prediction (measured on this 2-core box: a quiet 64 KiB
  all-reduce can cost as much as a 2 MiB one when the machine is loaded, and a fifth of it when
  not). Then the doctor predicts with two links (:func:`job_links`), a prior's α:β scaled to the
  trace and one all latency, reports their mean and carries their range into its interval;
- the **uncertainty** is what a re-run would see. Each step's prediction at the job's own cap
  is set against that step's measured exposure: the median miss and the spread of one step
  (a standard deviation: a loaded machine's steps have heavy tails, which a re-run has too). A
  re-run measures the median of as many steps, so the realized gain (this trace's measured
  exposure minus the re-run's) gets an interval: the prediction there, ± 1.645 standard errors
  of that median, ± the miss, ± half the two links' range (:meth:`Diagnosis.interval_at`);
- the doctor **advises** a cap only when the model reproduces the job's own cap (miss within
  30%, 1 ms or the noise) and the whole interval is a gain; otherwise it says why it does not.

On GPU (NCCL) nothing busy is slowed by sharing cores (its contention factor comes out near 1)
and NCCL runs one stream, so the what-if has one lane.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dplab._units import MIB
from dplab.ddp.buckets import (
    DEFAULT_BUCKET_CAP_MB,
    DEFAULT_FIRST_BUCKET_CAP_MB,
    torch_first_bucket_cap,
)
from dplab.doctor.budget import Budget, step_budgets
from dplab.doctor.from_trace import (
    MEDIAN_SE,
    BucketRow,
    StepRow,
    bucket_rows,
    by_step,
    job_links,
    measured_steps,
    prior_link,
    profile_from_trace,
    simulate_lanes,
)
from dplab.doctor.straggler import Straggler, find_straggler
from dplab.sim.contention import Contention
from dplab.sim.engine import candidate_caps, plan_buckets
from dplab.sim.link import Link, get_link
from dplab.sim.profile import BackwardProfile
from dplab.trace.profiler import from_profiler
from dplab.trace.step import StepTrace

# torch's first bucket for DistributedDataParallel(bucket_cap_mb=cap): 1 MiB only when the cap
# is left at its default (None), else the cap itself. Every cap the doctor advises is explicit.
first_cap = torch_first_bucket_cap

Z_90 = 1.645  # a two-sided 90% interval of a normal spread
TRUST_SHARE, TRUST_MS = 0.30, 1.0  # the model must reproduce the job's own cap this well


# -- the current cap ---------------------------------------------------------------------------


def _sizes(trace: StepTrace) -> list[int]:
    """The buckets' gradient bytes (what torch's cap counts; a comm hook may send fewer)."""
    held = trace.meta.get("bucket_grad_bytes")
    if held and all(x is not None for x in held):
        return [int(x) for x in held]
    return [b.nbytes for b in sorted(trace.buckets, key=lambda b: b.index)]


def _plan_sizes(profile: BackwardProfile, cap: float, first: float) -> list[int]:
    plan = plan_buckets(profile, bucket_cap_mb=cap, first_bucket_cap_mb=first)
    return [b.nbytes for b in plan]


def consistent_with_default(profile: BackwardProfile, observed: Sequence[int]) -> bool:
    """Could torch's default caps (25 MiB, first bucket 1 MiB) have cut these buckets?

    Judged on the sizes alone, not on one order of the gradients: torch cut its buckets once,
    in the order rank 0's gradients became ready in its first iteration, which the profiled
    steps need not repeat exactly. Every bucket but the last must have reached its cap, and no
    bucket may hold more than its cap plus the largest gradient (the one that crossed it).
    """
    if not observed or sum(observed) != profile.total_bytes:
        return False
    largest = max(p.nbytes for p in profile.params)
    caps = [DEFAULT_FIRST_BUCKET_CAP_MB * MIB] + [DEFAULT_BUCKET_CAP_MB * MIB] * len(observed)
    last = len(observed) - 1
    return all(
        size < cap + largest and (k == last or size >= cap)
        for k, (size, cap) in enumerate(zip(observed, caps, strict=False))
    )


def infer_cap(
    profile: BackwardProfile, observed: Sequence[int]
) -> tuple[float, float, tuple[float, float]]:
    """The job's bucket cap, from its buckets: the caps whose plan gives exactly those buckets.

    Returns (cap, first bucket's cap, the range of fitting caps tried): torch's default (25 MiB,
    first bucket 1 MiB) if the buckets are consistent with it (:func:`consistent_with_default`),
    else the largest fitting explicit cap (every cap in the range cuts the same buckets, so the
    what-if is the same for all of them).
    """
    if consistent_with_default(profile, observed):
        default = (DEFAULT_BUCKET_CAP_MB, DEFAULT_FIRST_BUCKET_CAP_MB)
        return (*default, (DEFAULT_BUCKET_CAP_MB,) * 2)
    tried = sorted({round(s / MIB, 6) for s in observed if s} | set(candidate_caps(profile)))
    fits = [c for c in tried if _plan_sizes(profile, c, first_cap(c)) == list(observed)]
    if not fits:
        raise ValueError(
            f"no bucket cap reproduces this job's buckets ({list(observed)} bytes); "
            "pass the job's cap (current_cap_mb=, --current-cap-mb)"
        )
    return fits[-1], first_cap(fits[-1]), (fits[0], fits[-1])


def one_bucket_cap(profile: BackwardProfile) -> float:
    """The smallest cap tried (E12 caps and the gradients' total) whose explicit plan puts
    every gradient in one bucket: every cap above it does too."""
    tried = sorted({*candidate_caps(profile), profile.total_bytes / MIB})
    return next(c for c in tried if len(_plan_sizes(profile, c, c)) == 1)


def _current_cap(
    profile: BackwardProfile,
    observed: list[int],
    current_cap_mb: float | None,
    ddp_logging_data: Mapping[str, Any] | None,
) -> tuple[float, float, str]:
    """(cap, first bucket's cap, where the cap came from): given, logged by torch, or inferred."""
    logged = (ddp_logging_data or {}).get("bucket_cap_bytes")
    if current_cap_mb is None and not logged:
        cap, first, (lo, hi) = infer_cap(profile, observed)
        if lo == hi == DEFAULT_BUCKET_CAP_MB:
            return cap, first, "inferred: torch's default"
        if len(observed) == 1:
            # every cap from lo up gives this bucket: no one of them is "the" job's cap
            return (
                cap,
                first,
                "inferred: an explicit cap (torch's default cuts a 1 MiB first bucket)",
            )
        return (
            cap,
            first,
            f"inferred: every cap tried from {lo:.3g} to {hi:.3g} MiB gives these buckets",
        )
    if current_cap_mb is not None:
        cap, source = float(current_cap_mb), "given"
    else:
        cap, source = int(logged) / MIB, "from ddp._get_ddp_logging_data()"
    # torch's default cap has a 1 MiB first bucket; an explicit one does not
    first = next(
        (f for f in (cap, DEFAULT_FIRST_BUCKET_CAP_MB) if _plan_sizes(profile, cap, f) == observed),
        cap,
    )
    return cap, first, source


@dataclass(frozen=True)
class CapRow:
    """The what-if at one cap: predicted step time and exposure (medians over the steps)."""

    cap_mb: float
    t_step_ms: float
    exposed_ms: float
    low_ms: float  # the exposure's bounds when the trace leaves α:β open (see job_links)
    high_ms: float


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
    """What the doctor read and predicts. ``gain``: the predicted gain over the steps;
    ``gain_interval``: where the realized gain of a re-run at ``best_cap_mb`` should fall (90%,
    see the module notes); ``trusted``: whether the model reproduced the job's own cap."""

    world_size: int
    backend: str
    steps: list[int]
    current_cap_mb: float
    current_first_cap_mb: float
    cap_source: str
    link: Link
    measured: list[StepRow]
    buckets: list[BucketRow]
    predicted_current: Spread
    best_cap_mb: float
    predicted_best: Spread
    gain: Spread
    model_miss_ms: float
    recommend: bool
    noise_ms: float = 0.0  # the standard error of a re-run's median exposure
    trusted: bool = True
    contention: Contention | None = None
    latency_link: Link | None = None  # the all-latency bound, when the trace leaves α:β open
    straggler: Straggler | None = None
    sweep: list[CapRow] = field(default_factory=list)
    simulated_best: StepTrace | None = None
    simulated_current: StepTrace | None = None
    budget: Budget | None = None
    one_bucket_mb: float | None = None  # when one bucket holds every gradient: any cap ≥ this
    nccl: bool = False  # read on the NCCL (GPU) path, which no GPU run has verified yet
    sent_share: float = 1.0  # bytes the all-reduces sent over the gradients' (a hook compresses)

    @property
    def cap_advised(self) -> bool:
        """Whether the summary advises a cap: the what-if recommends one (``recommend``) and
        the exposed communication is the largest part of the step (a cap moves only that)."""
        return self.recommend and (self.budget is None or self.budget.comms_bound)

    def _cap(self) -> str:
        """The job's cap in the user's words (what they set, or what the buckets allow)."""
        if self.one_bucket_mb is not None and self.cap_source.startswith("inferred"):
            default = "torch's default or " if self.cap_source.endswith("default") else ""
            return f"{default}any cap ≥ {self.one_bucket_mb:.3g} MiB"
        return f"{self.current_cap_mb:.3g} MiB"

    def cap_words(self) -> str:
        """The job's cap and where it was read, for the summary's first line."""
        if self.one_bucket_mb is None:
            return f"bucket cap {self.current_cap_mb:.3g} MiB ({self.cap_source})"
        if self.cap_source.startswith("inferred"):
            return f"one bucket holds every gradient: {self._cap()} ({self.cap_source})"
        return (
            f"bucket cap {self.current_cap_mb:.3g} MiB ({self.cap_source}); one bucket holds "
            f"every gradient: any cap ≥ {self.one_bucket_mb:.3g} MiB, "
            f"{self.current_cap_mb:.3g} included"
        )

    @property
    def measured_exposed(self) -> Spread:
        return Spread.of([m.exposed_ms for m in self.measured])

    def interval_at(self, cap_mb: float) -> tuple[float, float]:
        """Where the realized gain of a re-run at ``cap_mb`` (one of the caps tried) should
        fall, 90%: this trace's measured exposure minus the prediction there, give or take a
        re-run's noise and the model's miss at the current cap."""
        row = next((s for s in self.sweep if math.isclose(s.cap_mb, cap_mb)), None)
        if row is None:
            tried = [s.cap_mb for s in self.sweep]
            raise ValueError(f"cap {cap_mb!r} MiB was not tried (tried: {tried}); pass caps=")
        centre = self.measured_exposed.median - row.exposed_ms
        half = Z_90 * self.noise_ms + self.model_miss_ms + (row.high_ms - row.low_ms) / 2
        return centre - half, centre + half

    @property
    def gain_interval(self) -> tuple[float, float]:
        """:meth:`interval_at` the best cap."""
        return self.interval_at(self.best_cap_mb)

    def recommendation(self) -> str:
        lo, hi = self.gain_interval
        if not self.trusted:
            return (
                f"no advice: the model misses the job's own cap ({self._cap()}) "
                f"by {self.model_miss_ms:.2f} ms (predicted {self.predicted_current.median:.2f}, "
                f"measured {self.measured_exposed.median:.2f} ms), more than "
                f"{TRUST_SHARE:.0%} or {TRUST_MS:g} ms: its what-if cannot be trusted here"
            )
        if not self.recommend:
            return (
                f"keep the cap ({self._cap()}): the best cap tried, "
                f"{self.best_cap_mb:.3g} MiB, would gain {self.gain.median:.2f} ms per step, "
                f"but a re-run could realize anything from {lo:.2f} to {hi:.2f} ms: within the "
                f"noise (a step's exposure varies by ± {self.noise_ms:.2f} ms in a median of "
                f"{len(self.steps)} steps; the model's miss at the current cap is "
                f"{self.model_miss_ms:.2f} ms)"
            )
        return (
            f"with bucket_cap_mb={self.best_cap_mb:.3g} this job would expose "
            f"{self.predicted_best.median:.2f} ms instead of {self.predicted_current.median:.2f} "
            f"ms (measured: {self.measured_exposed.median:.2f} ms) per step: a re-run should "
            f"gain {lo:.2f} to {hi:.2f} ms (90%; the noise of {len(self.steps)} steps and the "
            f"model's miss of {self.model_miss_ms:.2f} ms at the current cap)"
        )

    def summary(self) -> str:
        lines = [
            f"{self.world_size} ranks ({self.backend}), profiled steps {self.steps}, "
            + self.cap_words(),
            "NCCL path unverified on hardware: "
            + (
                "this GPU trace was read by it; check its numbers against the profiler's own"
                if self.nccl
                else "this trace was read on the gloo (CPU) path, checked against torch's DDP"
            ),
            f"link: {self.link.describe()}  [{self.link.source}]",
        ]
        if not math.isclose(self.sent_share, 1.0):
            lines.append(
                f"comm hook: the all-reduces send {self.sent_share:.0%} of the gradients' bytes "
                "(compressed); the link is fitted per gradient byte, so the what-if keeps the hook"
            )
        if self.contention is not None and self.contention.alpha_factor > 1:
            lines.append(
                f"contention: an all-reduce beside a running backward costs "
                f"{self.contention.alpha_factor:.2f}x ({self.contention.probe.get('busy', 0)} "
                f"busy, {self.contention.probe.get('quiet', 0)} quiet all-reduces)"
            )
        if self.latency_link is not None:
            lines.append(
                "the quiet all-reduces are all one size, so latency and per-byte cost cannot be "
                "told apart: each prediction is the mean of that link's and an all-latency "
                f"one's ({self.latency_link.describe()}), and the interval spans both"
            )
        lines += [
            "",
            "per step (the rank whose backward ended last):",
            "  step   t_step ms   backward ms   comm ms   exposed ms   (exposed per rank)",
        ]
        for m in self.measured:
            per_rank = ", ".join(f"{x:.2f}" for x in m.exposed_by_rank)
            lines.append(
                f"  {m.step:>4}   {m.t_step_ms:9.2f}   {m.backward_ms:11.2f}   "
                f"{m.comm_ms:7.2f}   {m.exposed_ms:10.2f}   ({per_rank})"
            )
        lines.append(
            "straggler: " + (str(self.straggler) if self.straggler else "none (the ranks are even)")
        )
        lines += ["", "per bucket (medians over steps):", "  bucket   MiB     params   exposed ms"]
        for b in self.buckets:
            lines.append(
                f"  {b.index:>6}   {b.nbytes / MIB:6.3f}   {b.n_params:>6}   {b.exposed_ms:10.2f}"
            )
        if self.budget is not None:
            lines += ["", *self.budget.lines()]
        what_if = [
            f"predicted exposure at the current cap: {self.predicted_current}; measured: "
            f"{self.measured_exposed}",
            f"predicted exposure at {self.best_cap_mb:.3g} MiB: {self.predicted_best}",
        ]
        if self.budget is None or self.budget.comms_bound:
            return "\n".join([*lines, "", *what_if, "", "recommendation: " + self.recommendation()])
        largest = self.budget.largest
        return "\n".join(
            [
                *lines,
                "",
                f"recommendation: no cap advised: {largest}, not the exposed communication, is "
                "the largest part of the step, and a cap moves only the exposed communication",
                "",
                "the cap what-if (secondary):",
                *("  " + x for x in what_if),
                "  its advice: " + self.recommendation(),
            ]
        )


def _sweep(
    runs: list[list[StepTrace]],
    steps: list[int],
    tried: list[float],
    sims: Sequence[Callable[[BackwardProfile, float], StepTrace]],
) -> tuple[dict[float, list[float]], list[CapRow]]:
    """The what-if at every cap tried, one profile per step (a prediction is judged on every
    step, and a cap chosen on the medians), under each link: the per-step exposure predicted
    (the links' mean) and a row per cap with the links' range."""
    per_step = [profile_from_trace(runs, steps=[number]) for number in steps]
    exposed, sweep = {}, []
    for c in tried:
        by_link = [[sim(p, c).metrics for p in per_step] for sim in sims]
        exposed[c] = [
            statistics.fmean(m.exposed_comm_ms for m in ms) for ms in zip(*by_link, strict=True)
        ]
        medians = [statistics.median(m.exposed_comm_ms for m in ms) for ms in by_link]
        sweep.append(
            CapRow(
                cap_mb=c,
                t_step_ms=statistics.fmean(
                    statistics.median(m.t_step_ms for m in ms) for ms in by_link
                ),
                exposed_ms=statistics.median(exposed[c]),
                low_ms=min(medians),
                high_ms=max(medians),
            )
        )
    return exposed, sweep


def _runs_of(source: Any, ddp_logging_data: Mapping[str, Any] | None) -> list[list[StepTrace]]:
    if isinstance(source, list) and source and all(isinstance(r, list) for r in source):
        return source
    return from_profiler(source, ddp_logging_data=ddp_logging_data)


def _best(sweep: Sequence[CapRow], cap: float) -> float:
    """The cap that exposes least (compute is the same at every cap: what a cap changes is the
    exposure); among ties, the one nearest the current (the smallest change)."""
    least = min(s.exposed_ms for s in sweep)
    return min(
        (s for s in sweep if s.exposed_ms <= least + 1e-9),
        key=lambda s: abs(math.log(s.cap_mb / cap)),
    ).cap_mb


def _rerun_noise(predicted_current: Sequence[float], measured: Sequence[float]) -> float:
    """The standard error of a re-run's median exposure, from this trace's steps.

    The residuals (measured minus predicted, step by step at the current cap) hold the
    machine's noise and the model's error. A busy machine's steps have heavy tails (one step
    descheduled for milliseconds), which a MAD would call outliers and a re-run will have too:
    so σ is their standard deviation, and a median of m steps has ``MEDIAN_SE·σ/√m``.
    """
    residuals = [m - p for m, p in zip(measured, predicted_current, strict=True)]
    if len(residuals) < 2:
        return 0.0
    return MEDIAN_SE * statistics.stdev(residuals) / math.sqrt(len(residuals))


def diagnose(
    source: Any,
    *,
    link: str | Link | None = None,
    prior: str | Link | None = None,
    current_cap_mb: float | None = None,
    ddp_logging_data: Mapping[str, Any] | None = None,
    caps: Sequence[float] | None = None,
    reference: str | Link | None = None,
) -> Diagnosis:
    """Read a torch DDP job's profiler trace (or ``from_profiler``'s output) and diagnose it.

    ``link``: a preset name or a :class:`Link` to ask "what if on that fabric" (no contention);
    default: the job's own, fitted to the trace with its contention (:func:`job_link`;
    ``prior``: the link whose α:β shape the fit keeps when the buckets are all one size).
    ``current_cap_mb``: the job's cap, else read from ``ddp_logging_data['bucket_cap_bytes']``,
    else inferred from its buckets. ``caps``: the caps to try (default: E12 caps), and the job's.
    ``reference``: the link each all-reduce's achieved bandwidth is set against (default:
    ``link``, else :func:`prior_link`, this machine's measured loopback on gloo).
    """
    runs = _runs_of(source, ddp_logging_data)
    table, profile, n = by_step(runs), profile_from_trace(runs), runs[0][0].world_size
    steps = list(table)
    if link is None:
        links = job_links(runs, prior=get_link(prior) if prior else None)
        lanes = max(int(t.meta.get("comm_lanes", 1)) for rank in runs for t in rank)
    else:
        links, lanes = [(get_link(link), None)], 1
    the_link, contention = links[0]

    def sim(p: BackwardProfile, c: float, first: float | None = None, k: int = 0) -> StepTrace:
        return simulate_lanes(
            p,
            bucket_cap_mb=c,
            first_bucket_cap_mb=first_cap(c) if first is None else first,
            world_size=n,
            link=links[k][0],
            contention=links[k][1],
            lanes=lanes,
        )

    last = table[steps[-1]][0]
    observed = _sizes(last)
    cap, first, cap_source = _current_cap(profile, observed, current_cap_mb, ddp_logging_data)
    tried = sorted(set(candidate_caps(profile) if caps is None else caps) | {cap})
    sims = [
        functools.partial(lambda p, c, k: sim(p, c, first if c == cap else None, k), k=k)
        for k in range(len(links))
    ]
    predicted, sweep = _sweep(runs, steps, tried, sims)
    best = _best(sweep, cap)
    per_step_current, per_step_best = predicted[cap], predicted[best]
    measured = measured_steps(runs)
    noise = _rerun_noise(per_step_current, [m.exposed_ms for m in measured])
    measured_median = statistics.median(m.exposed_ms for m in measured)
    miss = abs(statistics.median(per_step_current) - measured_median)
    against, backend = reference or link, runs[0][0].backend
    d = Diagnosis(
        world_size=n,
        backend=runs[0][0].backend,
        steps=steps,
        current_cap_mb=cap,
        current_first_cap_mb=first,
        cap_source=cap_source,
        link=the_link,
        measured=measured,
        buckets=bucket_rows(runs),
        predicted_current=Spread.of(per_step_current),
        best_cap_mb=best,
        predicted_best=Spread.of(per_step_best),
        gain=Spread.of([c - b for c, b in zip(per_step_current, per_step_best, strict=True)]),
        model_miss_ms=miss,
        recommend=False,  # set below, from the interval
        noise_ms=noise,
        # a miss within the noise of the measured median is no evidence against the model
        trusted=miss <= max(TRUST_SHARE * measured_median, TRUST_MS, Z_90 * noise),
        contention=contention,
        latency_link=links[1][0] if len(links) > 1 else None,
        straggler=find_straggler(runs),
        sweep=sweep,
        simulated_best=sim(profile, best),
        simulated_current=sim(profile, cap, first),
        budget=step_budgets(runs, get_link(against) if against else prior_link(backend)),
        one_bucket_mb=one_bucket_cap(profile) if len(observed) == 1 else None,
        nccl=any(not t.meta.get("verified", True) for rank in runs for t in rank),
        sent_share=sum(b.nbytes for b in last.buckets) / sum(observed),
    )
    d.recommend = best != cap and d.trusted and d.gain_interval[0] > 0
    return d
