"""``ddp.reducer``: the few things torch's tests read from torch's C++ Reducer, from dplab.DDP.

torch's DDP keeps its bucketing state in a C++ ``Reducer`` object, and some of its own tests
(and some users) read it: the buckets as zero-filled ``GradBucket`` objects
(``_get_zeros_like_grad_buckets``), how many ranks used each parameter in the last synchronising
backward (``_get_local_used_map``, with ``find_unused_parameters``), and whether the set of unused
parameters has stayed the same from one iteration to the next (``_ddp_graph_static``: torch's
``search_unused_parameters`` turns it off the first time the set changes). dplab.DDP is its own
reducer; this view answers those three from it under torch's names, and refuses the rest by
name.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from dplab.ddp.comm_hooks import GradBucket


class ReducerView:
    """torch's ``ddp.reducer``, as far as dplab.DDP has the same thing."""

    def __init__(self, ddp: Any):
        self._ddp = weakref.ref(ddp)

    def _get_zeros_like_grad_buckets(self) -> list[GradBucket]:
        """One bucket per all-reduce, in reduction order, its buffer zero-filled."""
        ddp = self._ddp()
        buckets = [GradBucket.of(ddp._layout, ddp._params, b) for b in range(len(ddp.buckets))]
        for bucket in buckets:
            bucket.set_buffer(torch.zeros_like(bucket.buffer()))
        return buckets

    def _get_local_used_map(self) -> torch.Tensor:
        """Per parameter (index order), how many ranks used it since the last sync: the sum
        all-reduced at the end of the last synchronising backward (``find_unused_parameters``)."""
        ddp = self._ddp()
        return ddp._used_counts.to(ddp.device)

    def _ddp_graph_static(self) -> bool:
        """Has every forward so far left the same parameters unused? (Always true without
        ``find_unused_parameters``, which is when torch does not look.)"""
        return self._ddp()._graph_static

    def __getattr__(self, name: str) -> Any:
        raise NotImplementedError(
            f"dplab.DDP does not support ddp.reducer.{name}: it reaches into torch's C++ "
            "Reducer, which dplab.DDP replaces with Python (what dplab has of it: "
            "_get_zeros_like_grad_buckets, _get_local_used_map, _ddp_graph_static; its buckets "
            "are ddp.buckets and ddp.bucket_buffers). See docs/ddp.md."
        )
