"""How dplab.DDP picks its buckets: torch's caps and plans, or the textbook variant's.

Mixed into :class:`dplab.ddp.ddp.DDP`. The cutting rules themselves are in
:mod:`dplab.ddp.buckets`, the memory in :mod:`dplab.ddp.layout`; this is the choice between
them that the constructor's arguments make (``bucket_cap_mb``, ``bucket_cap_mb_list``,
``find_unused_parameters``, ``static_graph``, and dplab's ``first_bucket_cap_mb``,
``static_buckets``, ``rebuild_buckets``), and the one rebuild after the first step, over the
order in which rank 0's gradients became ready.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dplab.ddp.buckets import (
    DEFAULT_BUCKET_CAP_MB,
    cap_bytes,
    check_cap_mb,
    first_bucket_cap,
    torch_first_bucket_cap,
)
from dplab.ddp.layout import per_bucket_plan, static_plan, torch_plan


class PlanMixin:
    """The bucket plans of one DDP (see the module docstring)."""

    def _choose_buckets(
        self,
        bucket_cap_mb: float | None,
        bucket_cap_mb_list: list[float] | None,
        first_bucket_cap_mb: float | None,
        static_buckets: bool | None,
        rebuild_buckets: bool | None,
    ) -> None:
        """Bucket caps: torch's rule (``bucket_cap_mb_list``: one cap per bucket, the last one
        repeated; the cap is then its largest), or the textbook variant's."""
        self.static_buckets = (
            (first_bucket_cap_mb is not None or self.default_static_buckets)
            if static_buckets is None
            else bool(static_buckets)
        )
        caps = [check_cap_mb("bucket_cap_mb_list", c) for c in bucket_cap_mb_list or []]
        self.bucket_bytes_cap_list = [cap_bytes(c) for c in caps]  # torch's attribute
        if caps:
            bucket_cap_mb = max(caps)
        cap = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
        self.bucket_cap_mb = check_cap_mb("bucket_cap_mb", cap)
        self.bucket_bytes_cap = cap_bytes(self.bucket_cap_mb)
        self.broadcast_bucket_size = 250 * 1024 * 1024  # torch's; dplab broadcasts per dtype
        if first_bucket_cap_mb is not None or self.static_buckets:
            self.first_bucket_cap_mb = first_bucket_cap(self.bucket_cap_mb, first_bucket_cap_mb)
        else:
            self.first_bucket_cap_mb = torch_first_bucket_cap(bucket_cap_mb)
        if rebuild_buckets is None:
            # torch: with per-bucket caps the first buckets already are the final ones
            rebuild_buckets = not (self.static_buckets or self.find_unused_parameters or caps)
        self._rebuild_pending = bool(rebuild_buckets)

    def _caps(self) -> dict[str, float]:
        return {
            "bucket_cap_mb": self.bucket_cap_mb,
            "first_bucket_cap_mb": self.first_bucket_cap_mb,
        }

    def _initial_plan(self) -> list[list[int]]:
        """The buckets before the first step, as parameter indices in buffer order."""
        caps = self._caps()
        if self.bucket_bytes_cap_list:
            return per_bucket_plan(self._params, self.bucket_bytes_cap_list, self._sparse)
        if not self.static_buckets:
            find_unused = self.find_unused_parameters and not self._static_requested
            return torch_plan(
                self._params, None, find_unused=find_unused, sparse=self._sparse, **caps
            )
        return self._static_plan(list(reversed(range(len(self._params)))))

    def _static_plan(self, order: list[int]) -> list[list[int]]:
        """The textbook cut: buckets filled over ``order`` with caps ``[first, cap]``."""
        return static_plan(self._params, order, sparse=self._sparse, **self._caps())

    def _rebuilt_plan(self, order: list[int]) -> list[list[int]]:
        """The buckets over ``order``, the order rank 0's gradients became ready."""
        return torch_plan(
            self._params, order, find_unused=False, sparse=self._sparse, **self._caps()
        )

    def _bucket_bytes(self) -> tuple[list[int], list[int]]:
        """Each bucket's bytes, and its cap in bytes (what torch's logging data reports)."""
        sizes = [b.nbytes for b in self.buckets]
        if self.bucket_bytes_cap_list:
            caps = self.bucket_bytes_cap_list
            return sizes, [caps[min(i, len(caps) - 1)] for i in range(len(sizes))]
        first, cap = cap_bytes(self.first_bucket_cap_mb), self.bucket_bytes_cap
        return sizes, [first if i == 0 else cap for i in range(len(sizes))]

    def _rebuild_from_ready_order(self) -> None:
        """Rebuild once, in the order rank 0 saw gradients arrive (a collective: all agree)."""
        order = torch.full((len(self._params),), -1, dtype=torch.int64)
        if self.rank == 0 and len(self._ready_order) == len(self._params):
            order[:] = torch.tensor(self._ready_order)
        order = order.to(self._comm_device)
        if self.world_size > 1:
            dist.broadcast(order, src=self._src, group=self.process_group)
        self._rebuild_pending = False
        if (order < 0).any():
            return  # rank 0 did not see every gradient: keep the buckets we have
        self._build_buckets(self._rebuilt_plan(order.cpu().tolist()))
        self._reset_backward_state()
        self._observer.buckets_changed(self)
