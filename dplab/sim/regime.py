"""The appendix's slow fabric: one link between two real nodes, measured, then simulated.

Every rank of a :class:`dplab.nodes.Nodes` job runs :func:`link_rank` on a fast and on a shaped
link; :func:`link_of` fits each link's α and β from its all-reduce times, and :func:`link_table`
puts the measured DDP steps beside the simulator's step for the same link and compute profile.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from dplab.sim.engine import simulate
from dplab.sim.link import Link
from dplab.sim.profile import profile_from_ranks

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
    "allreduce_window_ms",
    "link_of",
    "link_rank",
    "link_table",
]
