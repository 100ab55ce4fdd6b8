"""The §8 exercise: predict which buckets' all-reduces are exposed.

The learner writes ``exposed_buckets(ready_ms, comm_ms, backward_end_ms)``: given when each
bucket is ready, how long its all-reduce takes, and when backward ends, which buckets still
communicate after backward is over? The rule is DDP's: one all-reduce at a time (NCCL's one
stream; the simulator's one lane), buckets in index order, each starting when it is ready *and*
the one before it is done.

The checker compares the answer with the simulator (:func:`dplab.sim.simulate`), which lays out
the same step independently, on steps built from a measured profile (or a made-up one) over
several links, world sizes and caps. Nothing runs on ranks, so it is instant.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dplab.ddp import first_bucket_cap
from dplab.exercises.checks import FAILED, NOT_ATTEMPTED, PASSED, CheckResult
from dplab.sim import PRESETS, BackwardProfile, Link, ParamTiming, simulate
from dplab.trace import StepTrace

EXERCISE = "predict the exposed buckets"
EPS_MS = 1e-6  # an all-reduce that ends this close to backward's end counts as hidden


@dataclass(frozen=True)
class Case:
    """One step to predict: the inputs the learner gets and the simulator's answer."""

    label: str
    ready_ms: list[float]
    comm_ms: list[float]
    backward_end_ms: float
    exposed: set[int]


def case_from_trace(trace: StepTrace, label: str = "") -> Case:
    """The learner's inputs from a simulated step (times from backward's start), and the
    buckets whose all-reduce has exposed time in it."""
    backward = trace.of("backward")[0]
    t0 = backward.start_ms
    ready = {s.bucket: s.start_ms - t0 for s in trace.of("bucket_ready")}
    comm = {s.bucket: s.duration_ms for s in trace.of("allreduce")}
    n = len(trace.buckets)
    exposed = {b for b, ms in trace.metrics.exposed_ms.items() if ms > EPS_MS}
    return Case(
        label or f"{n} buckets",
        [ready[b] for b in range(n)],
        [comm[b] for b in range(n)],
        backward.end_ms - t0,
        exposed,
    )


def _made_up_profile(rng: random.Random, n_params: int = 12) -> BackwardProfile:
    """A model with gradients of varied size, ready at increasing times in backward.

    Backward ends with its last gradient, as in a measured step (§4): so the last bucket is
    ready only when backward is over, and its all-reduce is always exposed.
    """
    times = sorted(rng.uniform(1.0, 60.0) for _ in range(n_params))
    params = []
    for i in range(n_params):  # registration order: the last registered is ready first
        nbytes = 4 * rng.choice((1_000, 50_000, 250_000, 1_000_000, 3_000_000))
        params.append(ParamTiming(f"layer{i}.weight", nbytes // 4, nbytes, "float32", 0.0))
    ready = list(reversed(times))
    params = [
        ParamTiming(p.name, p.numel, p.nbytes, p.dtype, ready[i]) for i, p in enumerate(params)
    ]
    return BackwardProfile("made-up", tuple(params), 10.0, times[-1], 2.0)


def cases(profile: BackwardProfile | None = None, *, seed: int = 0) -> list[Case]:
    """Steps to check against: ``profile`` (if given) and made-up models, over fabrics from a
    slow Ethernet to NVLink, world sizes 2 to 1,024 and several bucket caps."""
    rng = random.Random(seed)
    profiles = [profile] if profile is not None else []
    profiles += [_made_up_profile(rng) for _ in range(3)]
    links: list[Link] = [PRESETS["25gbe"], PRESETS["ib-400g"], Link("slow", 2e-4, 2e8)]
    out = []
    for p in profiles:
        for link in links:
            for n in (2, 64, 1024):
                for cap in (0.25, 1.0, 5.0):
                    trace = simulate(
                        p,
                        bucket_cap_mb=cap,
                        first_bucket_cap_mb=first_bucket_cap(cap),
                        world_size=n,
                        link=link,
                    )
                    out.append(case_from_trace(trace, f"{p.model}, {link.name}, N={n}, cap {cap}"))
    return out


def check_exposed_buckets(
    fn: Callable[[list[float], list[float], float], Any] | None,
    profile: BackwardProfile | None = None,
) -> CheckResult:
    """Run the learner's ``fn`` on every case; passed if it names exactly the exposed buckets."""
    if fn is None:
        return CheckResult(EXERCISE, NOT_ATTEMPTED, "write exposed_buckets, then re-run.")
    if not callable(fn):
        return CheckResult(EXERCISE, FAILED, f"expected a function, got {fn!r}")
    all_cases = cases(profile)
    for case in all_cases:
        try:
            got = fn(list(case.ready_ms), list(case.comm_ms), case.backward_end_ms)
        except NotImplementedError:
            return CheckResult(
                EXERCISE, NOT_ATTEMPTED, "replace `raise NotImplementedError` with your code."
            )
        except Exception as e:  # the learner's code: report whatever it raised
            return CheckResult(EXERCISE, FAILED, f"{case.label}: raised {type(e).__name__}: {e}")
        try:
            answer = {int(b) for b in got}
        except (TypeError, ValueError):
            return CheckResult(
                EXERCISE, FAILED, f"return a set (or list) of bucket indices, got {got!r}"
            )
        if answer != case.exposed:
            return CheckResult(
                EXERCISE,
                FAILED,
                f"{case.label}: you said {sorted(answer)}, the simulator says "
                f"{sorted(case.exposed)}. {_hint(case, answer)}",
                {"case": case},
            )
    return CheckResult(
        EXERCISE,
        PASSED,
        f"all {len(all_cases)} steps right: an all-reduce is exposed when its queue (ready, "
        "then the previous bucket done) pushes it past the end of backward.",
    )


def _hint(case: Case, answer: set[int]) -> str:
    naive = {
        b
        for b, (r, c) in enumerate(zip(case.ready_ms, case.comm_ms, strict=True))
        if r + c > case.backward_end_ms + EPS_MS
    }
    if answer == naive:
        return (
            "Each bucket waits for the one before it: it starts at max(its ready time, the "
            "previous all-reduce's end), not at its ready time."
        )
    return "Walk the buckets in order, keeping the time the link is free again."


def reference_exposed_buckets(
    ready_ms: Sequence[float], comm_ms: Sequence[float], backward_end_ms: float
) -> set[int]:
    """The answer, written out (for the tests and for after you have tried)."""
    free = 0.0
    exposed = set()
    for b, (ready, comm) in enumerate(zip(ready_ms, comm_ms, strict=True)):
        start = max(ready, free)
        free = start + comm
        if free > backward_end_ms + EPS_MS:
            exposed.add(b)
    return exposed
