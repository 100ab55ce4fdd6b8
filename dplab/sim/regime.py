"""The comms-bound regime: a per-rank batch sweep, measured and predicted side by side.

DP is comms-bound when the per-rank batch is small: the gradient (and so T_comm) is the same
whatever the batch, while T_compute shrinks with it. :func:`dplab.ddp.torch_as_it_is.regime_rank`
measures the sweep on real ranks; this module turns its samples into medians per batch
(:func:`measured_regime`), finds the crossover where T_compute ≥ T_comm (:func:`crossover`),
and asks the simulator the same question (:func:`predicted_regime`): one
:class:`~dplab.sim.profile.BackwardProfile` per batch built from the *compute-only* steps of
the same sweep, and a link fitted on the same ranks (:func:`link_from_rows`).

What the prediction leaves out: by default ``simulate`` lets communication and compute overlap
for free. On 2 CPU cores gloo's threads take cores from backward (and backward from them), so the
measured T_compute of a DDP step is longer than the compute-only one at the same batch; the
predicted crossover therefore comes no later than the measured one unless contention is passed.

The appendix's slow fabric is the same question on two real nodes (``dplab.nodes``): every rank
runs :func:`link_rank` on a fast and on a shaped link, :func:`link_of` fits each link's α and β,
and :func:`link_table` puts the measured steps beside the simulator's.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dplab.sim.engine import simulate
from dplab.sim.link import Link
from dplab.sim.profile import BackwardProfile, profile_from_ranks

# The buckets dplab.DDP (and torch) use after the rebuild, with bucket_cap_mb left at default:
# a 1 MiB first bucket, then 25 MiB ones, over the ready order (reverse registration for an MLP).
TORCH_CAPS_MB = (25.0, 1.0)


@dataclass(frozen=True)
class RegimePoint:
    """Medians over repeats and ranks at one per-rank batch, in ms (``spread``: min, max)."""

    batch: int
    t_compute_ms: float
    t_comm_ms: float
    exposed_ms: float
    step_ms: float
    n: int
    spread: dict[str, tuple[float, float]]

    @property
    def exposed_share(self) -> float:
        """The share of the step spent in exposed communication."""
        return self.exposed_ms / self.step_ms if self.step_ms > 0 else 0.0

    @property
    def compute_bound(self) -> bool:
        return self.t_compute_ms >= self.t_comm_ms


def _med_spread(values: Sequence[float]) -> tuple[float, tuple[float, float]]:
    return statistics.median(values), (min(values), max(values))


def measured_regime(per_rank: Sequence[Any]) -> list[RegimePoint]:
    """One point per batch from every rank's :class:`RegimeRank` (``regime_rank``'s result).

    T_compute is the traced backward (``t_backward_ms``: what the all-reduces can hide under),
    T_comm the union of the all-reduce spans, exposed the part of it outside backward.
    """
    if not per_rank:
        raise ValueError("no rank results: run regime_rank on the ranks first")
    by_batch: dict[int, list[Any]] = {}
    for rank in per_rank:
        for s in rank.samples:
            by_batch.setdefault(s.batch, []).append(s.trace.metrics)
    points = []
    for batch in sorted(by_batch):
        ms = by_batch[batch]
        cols = {
            "t_compute_ms": [m.t_backward_ms for m in ms],
            "t_comm_ms": [m.t_comm_ms for m in ms],
            "exposed_ms": [m.exposed_comm_ms for m in ms],
            "step_ms": [m.t_step_ms for m in ms],
        }
        meds, spread = {}, {}
        for key, values in cols.items():
            meds[key], spread[key] = _med_spread(values)
        points.append(RegimePoint(batch=batch, n=len(ms), spread=spread, **meds))
    return points


def crossover(points: Sequence[RegimePoint]) -> int | None:
    """The smallest batch from which on T_compute ≥ T_comm at every larger batch (None: never).

    "From which on" rather than "the first": one noisy point above the line at a small batch is
    not a crossover if the next batch falls back below it.
    """
    ordered = sorted(points, key=lambda p: p.batch)
    found = None
    for p in reversed(ordered):
        if not p.compute_bound:
            break
        found = p.batch
    return found


def profiles_by_batch(per_rank: Sequence[Any]) -> dict[int, BackwardProfile]:
    """A :class:`BackwardProfile` per batch from the sweep's compute-only steps (no DDP).

    Each rank's samples of one batch are combined the way :func:`measure_profile` combines
    steps (per step the slowest rank, then medians): the same code, the same definition.
    """
    first = per_rank[0]
    batches = sorted({s.batch for s in first.samples})
    out = {}
    for batch in batches:
        results = [
            {
                "params": rank.params,
                "samples": [s.compute for s in rank.samples if s.batch == batch],
                "divide_ms_per_mib": [0.0],
                "world_size": rank.world_size,
                "backend": rank.backend,
                "device": "cpu",
            }
            for rank in per_rank
        ]
        out[batch] = profile_from_ranks(
            f"wide-mlp-{first.width}x{first.depth}",
            results,
            meta={"batch_size": batch, "source": "regime_rank compute-only steps"},
        )
    return out


def link_from_rows(rows: Sequence[Any], world_size: int = 2) -> Link:
    """The α-β link of ``dist.all_reduce`` measured on these ranks (``measure_bandwidth`` rows)."""
    from dplab.collectives import fit_rows

    fits = fit_rows(rows)
    key = ("all_reduce", world_size)
    if key not in fits:
        raise ValueError(f"no all_reduce rows at world size {world_size} to fit a link from")
    fit = fits[key]
    return Link.from_beta(
        "gloo loopback, these ranks",
        fit.alpha_s,
        fit.beta_s_per_byte,
        source=f"fitted now over {fit.n_points} sizes, max rel. error {fit.max_rel_error:.0%}",
    )


def predicted_regime(
    profiles: dict[int, BackwardProfile], link: Link, *, world_size: int = 2, contention: Any = None
) -> list[RegimePoint]:
    """The simulator's point for each batch: torch's rebuilt buckets, ``link``, free overlap
    (unless ``contention`` is given)."""
    points = []
    for batch in sorted(profiles):
        trace = simulate(
            profiles[batch],
            bucket_cap_mb=TORCH_CAPS_MB[0],
            first_bucket_cap_mb=TORCH_CAPS_MB[1],
            world_size=world_size,
            link=link,
            contention=contention,
        )
        m = trace.metrics
        values = {
            "t_compute_ms": m.t_backward_ms,
            "t_comm_ms": m.t_comm_ms,
            "exposed_ms": m.exposed_comm_ms,
            "step_ms": m.t_step_ms,
        }
        spread = {k: (v, v) for k, v in values.items()}
        points.append(RegimePoint(batch=batch, n=1, spread=spread, **values))
    return points


def regime_table(measured: Sequence[RegimePoint], predicted: Sequence[RegimePoint]) -> str:
    """Measured and predicted side by side, one line per batch (ms)."""
    lines = [
        "batch | measured: compute  comm  exposed  step  exp.% | predicted: compute  comm  exposed",
    ]
    pred = {p.batch: p for p in predicted}
    for m in measured:
        p = pred.get(m.batch)
        right = (
            f"{p.t_compute_ms:8.1f} {p.t_comm_ms:5.1f} {p.exposed_ms:8.1f}" if p else "   (none)"
        )
        lines.append(
            f"{m.batch:5d} | {m.t_compute_ms:17.1f} {m.t_comm_ms:5.1f} {m.exposed_ms:8.1f} "
            f"{m.step_ms:5.1f} {m.exposed_share:5.0%} | {right}"
        )
    return "\n".join(lines)


# -- the appendix's slow fabric: two real nodes, one link, measured then simulated ----------------

# All-reduce sizes for each link's α-β fit. On the slow link tbf lets one burst of 256 KiB through
# at full speed, so its sizes start at 1 MiB; on the fast link they reach 8 MiB, so that the bytes,
# not the noise of a busy machine, set β.
LINK_SIZES = {"slow": (2**20, 2**21, 2**22), "fast": (2**16, 2**20, 2**23)}
METRICS = ("t_compute_ms", "t_comm_ms", "exposed_comm_ms", "t_step_ms")


def link_rank(model: str, caps: Sequence[float], sizes: Sequence[int], batch_size: int) -> dict:
    """Run on every rank of a :class:`dplab.nodes.Nodes` job: this link's all-reduce times
    (``bandwidth_bench``), the model's compute with no communication (``profile_rank``), then
    two traced DDP steps at each bucket cap."""
    from dplab.collectives.bench import bandwidth_bench
    from dplab.ddp import first_bucket_cap, measure_ddp
    from dplab.sim.profile import profile_rank

    rows = bandwidth_bench(list(sizes), repeats=3, warmup=1)
    profile = profile_rank(model, batch_size=batch_size, steps=3, warmup=1, contention_repeats=0)
    steps = {
        cap: measure_ddp(
            model,
            bucket_cap_mb=cap,
            first_bucket_cap_mb=first_bucket_cap(cap),
            batch_size=batch_size,
            steps=2,
        )
        for cap in caps
    }
    return {"rows": rows, "profile": profile, "steps": steps}


def link_of(name: str, per_rank: Sequence[dict]) -> Link:
    """The α-β fit of one link's all-reduces (the slowest rank's times, as every row holds)."""
    from dplab.collectives import fit_rows

    rows = per_rank[0]["rows"]
    fit = fit_rows(rows)[("all_reduce", rows[0].world_size)]
    return Link.from_beta(f"{name} link", fit.alpha_s, fit.beta_s_per_byte,
                          source=f"fitted now to {len(rows)} all-reduce sizes")  # fmt: skip


def allreduce_window_ms(step: Any) -> float:
    """From a step's first all-reduce start to its last all-reduce end: every gradient byte
    crosses the link inside this window, whatever the bucket cap."""
    spans = step.of("allreduce")
    return max(a.end_ms for a in spans) - min(a.start_ms for a in spans)


def link_table(
    model: str, runs: dict[str, Sequence[dict]], links: dict[str, Link], caps: Sequence[float]
) -> dict[tuple[str, float], dict[str, float]]:
    """Per link and cap: the medians over every rank's traced steps of :data:`METRICS`, the
    buckets, the all-reduce window of the fastest step (first start to last end), and the
    simulator's step from that link and that run's compute profile."""
    from dplab.ddp import first_bucket_cap

    out = {}
    for name, per_rank in runs.items():
        profile = profile_from_ranks(model, [r["profile"] for r in per_rank])
        for cap in caps:
            steps = [s for r in per_rank for s in r["steps"][cap]]
            row = {k: statistics.median(getattr(s.metrics, k) for s in steps) for k in METRICS}
            row["buckets"] = len(steps[0].buckets)
            row["window_ms"] = min(allreduce_window_ms(s) for s in steps)
            row["gradient_bytes"] = profile.total_bytes
            world = per_rank[0]["rows"][0].world_size
            row["simulated_ms"] = simulate(
                profile, bucket_cap_mb=cap, first_bucket_cap_mb=first_bucket_cap(cap),
                world_size=world, link=links[name],
            ).metrics.t_step_ms  # fmt: skip
            out[name, cap] = row
    return out


__all__ = [
    "LINK_SIZES",
    "METRICS",
    "TORCH_CAPS_MB",
    "RegimePoint",
    "allreduce_window_ms",
    "crossover",
    "link_from_rows",
    "link_of",
    "link_rank",
    "link_table",
    "measured_regime",
    "predicted_regime",
    "profiles_by_batch",
    "regime_table",
]
