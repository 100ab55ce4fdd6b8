"""The straggler: in a multi-rank trace, the rank the others wait for, and by how much.

Every rank leaves an all-reduce together, so a slow rank makes every rank's step slow and the
per-rank step (and backward) times look alike: the all-reduce is a barrier. What differs is the
wait inside it. The slow rank arrives last and waits least; the others' extra wait is how far
behind it is. :func:`find_straggler` reads that from the per-rank exposed time of each step.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from dplab.doctor.from_trace import MAD_SIGMA, MEDIAN_SE, by_step
from dplab.trace.step import StepTrace


@dataclass(frozen=True)
class Straggler:
    """The rank the others wait for, and by how much per step.

    All ranks leave the all-reduce together, so their steps look equally long; what differs is
    how long each waited in it. The slow rank arrives last and waits least: the others' extra
    wait (``behind_ms``, median over steps) is how far behind it is.
    """

    rank: int
    behind_ms: float
    noise_ms: float  # the standard error of behind_ms (from the steps' spread)
    steps: int
    exposed_by_rank: tuple[float, ...]  # each rank's median exposed (waiting) ms per step

    def __str__(self) -> str:
        return (
            f"rank {self.rank} is a straggler: the other ranks wait {self.behind_ms:.2f} ms "
            f"longer for it per step (± {self.noise_ms:.2f} ms, {self.steps} steps)"
        )


def find_straggler(
    runs: Sequence[Sequence[StepTrace]], *, floor_ms: float = 1.0
) -> Straggler | None:
    """The rank that waits least in the all-reduces, when it does so beyond the noise; else None.

    Per step, each rank's lead over the rank that waited most but it (its exposed ms subtracted
    from the most any other rank exposed) is how far behind the others it was. The rank with
    the largest median lead is named when that median exceeds ``floor_ms`` and three times its
    own standard error (:data:`MEDIAN_SE` · σ/√steps, σ from the leads' MAD): ranks that are
    equal lead by chance, half the steps each, and are not named.
    """
    table = by_step(runs)
    ranks = sorted({t.rank for traces in table.values() for t in traces})
    if len(ranks) < 2:
        return None
    exposed = {r: [] for r in ranks}
    leads: dict[int, list[float]] = {r: [] for r in ranks}
    for traces in table.values():
        by_rank = {t.rank: t.metrics.exposed_comm_ms for t in traces}
        for r in ranks:
            exposed[r].append(by_rank[r])
            leads[r].append(max(v for q, v in by_rank.items() if q != r) - by_rank[r])
    rank = max(ranks, key=lambda r: statistics.median(leads[r]))
    behind = statistics.median(leads[rank])
    mad = statistics.median(abs(x - behind) for x in leads[rank])
    noise = MEDIAN_SE * MAD_SIGMA * mad / math.sqrt(len(leads[rank]))
    if behind <= max(floor_ms, 3 * noise):
        return None
    return Straggler(
        rank=rank,
        behind_ms=behind,
        noise_ms=noise,
        steps=len(leads[rank]),
        exposed_by_rank=tuple(statistics.median(exposed[r]) for r in ranks),
    )
