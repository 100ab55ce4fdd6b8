"""Collect one reply per rank: the state machine shared by the warm pool and :mod:`dplab.nodes`.

    waiting ──every rank replied──────────────▶ done (results, or the errors to raise)
       │ a rank failed: grace ERROR_GRACE_S ──▶ over (the ranks still pending are stuck)
       └ the deadline passed ─────────────────▶ timed out

After one rank fails, the others get ``ERROR_GRACE_S`` to finish: a peer that waits in a
collective the failed rank never joins would wait forever, so once the grace is over the caller
stops them. Where the replies come from (pipes, result files) and what "stop" means stay with
the caller; this class only keeps the books and the two clocks.
"""

from __future__ import annotations

import time
from typing import Any

from dplab.launch.errors import RankError

# After one rank fails, how long the others get to finish before they are presumed stuck in a
# collective that will never complete and are stopped.
ERROR_GRACE_S = 2.0
# How often a wait wakes to look at the ranks (collective counts, exit codes) and at the clock.
POLL_S = 0.2


class Replies:
    """The books of one call on ``world_size`` ranks, and its deadline and grace period."""

    def __init__(self, world_size: int, timeout_s: float, *, grace_s: float = ERROR_GRACE_S):
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self.pending: set[int] = set(range(world_size))
        self.results: dict[int, Any] = {}
        self.errors: dict[int, str] = {}  # in the order they came: the first is the likely cause
        self.summaries: dict[int, str] = {}
        self.deadline = time.monotonic() + timeout_s
        self.grace_end: float | None = None

    # -- what happened --------------------------------------------------------------------------

    def ok(self, rank: int, value: Any) -> None:
        """``rank`` returned ``value``."""
        self.pending.discard(rank)
        self.results[rank] = value

    def error(self, rank: int, text: str, *, summary: str | None = None) -> None:
        """``rank`` raised or died; ``text`` is its traceback or how it died."""
        self.pending.discard(rank)
        self.errors.setdefault(rank, text)
        if summary is not None:
            self.summaries.setdefault(rank, summary)
        self.failed()

    def failed(self) -> None:
        """Something failed (a rank, or a launcher process): the grace period starts now."""
        if self.grace_end is None:
            self.grace_end = time.monotonic() + self.grace_s

    # -- the clocks -----------------------------------------------------------------------------

    @property
    def over(self) -> bool:
        """Stop waiting: every rank replied, or the clocks ran out (:attr:`expired`)."""
        return not self.pending or self.expired

    @property
    def expired(self) -> bool:
        """The grace after a failure ended, or the deadline passed."""
        return self.wait_s() <= 0

    def wait_s(self, poll_s: float = POLL_S) -> float:
        """How long the caller may block before looking again (never past a deadline)."""
        end = self.deadline if self.grace_end is None else min(self.deadline, self.grace_end)
        return max(0.0, min(poll_s, end - time.monotonic()))

    # -- the verdict ----------------------------------------------------------------------------

    def raise_errors(self) -> None:
        """Raise the first failure as a RankError (the others attached), if any rank failed."""
        if not self.errors:
            return
        first = next(iter(self.errors))
        others = {r: tb for r, tb in self.errors.items() if r != first}
        raise RankError(first, self.errors[first], others=others, summary=self.summaries.get(first))

    def in_rank_order(self) -> list[Any]:
        return [self.results[r] for r in range(self.world_size)]
