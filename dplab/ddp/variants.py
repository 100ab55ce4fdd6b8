"""The lessons' teaching variants of dplab.DDP: each changes one decision and shows its cost.

- :class:`PerParameterDDP`: no buckets (one all-reduce per gradient: latency-bound);
- :class:`ForwardOrderDDP`: buckets in forward order (nothing can start before backward ends);
- :class:`NaiveDDP`: no overlap at all (all-reduce after backward, one at a time).
"""

from __future__ import annotations

from dplab.ddp.ddp import DDP


class PerParameterDDP(DDP):
    """Teaching variant: every gradient its own asynchronous all-reduce (no buckets).

    The overlap is there, but a model with hundreds of tensors pays hundreds of collective
    latencies: the latency-bound end of the bucket-size trade-off.
    """

    default_static_buckets = True

    def _initial_plan(self) -> list[list[int]]:
        return [[i] for i in reversed(range(len(self._params)))]

    def _rebuilt_plan(self, order: list[int]) -> list[list[int]]:
        return [[i] for i in order]


class ForwardOrderDDP(DDP):
    """Teaching variant: buckets cut in registration (forward) order, never rebuilt.

    Bucket 0 then holds the first layers, whose gradients backward delivers last. Buckets are
    launched strictly in index order (every rank must issue the same collectives in the same
    sequence), so no all-reduce can start before backward is over: what reverse order avoids.
    """

    default_static_buckets = True

    def _initial_plan(self) -> list[list[int]]:
        return self._static_plan(list(range(len(self._params))))

    def _rebuilt_plan(self, order: list[int]) -> list[list[int]]:
        return self._initial_plan()


class NaiveDDP(PerParameterDDP):
    """Teaching variant: wait for the whole backward, then all-reduce gradient after gradient.

    Nothing overlaps: every millisecond of communication is exposed.
    """

    launch_when_ready = False

    def _launch(self, b: int) -> None:
        super()._launch(b)
        self._st.works[-1].wait()  # blocking, one at a time


__all__ = ["ForwardOrderDDP", "NaiveDDP", "PerParameterDDP"]
