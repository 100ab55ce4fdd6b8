"""Uneven inputs: dplab.DDP under torch's ``Join`` context manager.

When ranks have different numbers of batches, a rank that runs out would leave the others
waiting in their next all-reduce forever. torch's ``torch.distributed.algorithms.join.Join``
fixes that with a *join hook*: a rank that has joined (run out of inputs) keeps answering every
collective the others still issue, once per their iteration, contributing zeros, until every
rank has joined; then the last rank to join broadcasts the final model. This module is that
hook for dplab.DDP, collective for collective as torch's ``_DDPJoinHook``
(torch/nn/parallel/distributed.py), in the same order as a non-joined rank issues them:

1. ``Join`` itself: an all-reduce that counts the ranks not yet joined;
2. the bucket rebuild's broadcast, once, if it is still to come;
3. the buffers' broadcast, from the highest rank still training;
4. an all-reduce that says whether this iteration synchronises (``no_sync`` skips 5-6);
5. one all-reduce of zeros per bucket, in bucket order (through the comm hook, if any);
6. with ``find_unused_parameters``: the all-reduce of the used-parameter flags.

Gradients are divided by the initial world size (default), or by the ranks still training
(``divide_by_initial_world_size=False``), as torch's reducer does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from dplab.ddp.backward_state import globally_unused
from dplab.ddp.comm_hooks import GradBucket, run_comm_hook
from dplab.ddp.replicas import broadcast_from


class DDPJoinHook(JoinHook):
    """What a joined rank does in place of each iteration of the others, and at the end."""

    def __init__(self, ddp: Any, divide_by_initial_world_size: bool):
        ddp._logging.data["join_uneven_inputs"] = 1
        ddp._divide_by_initial_world_size = divide_by_initial_world_size
        self.ddp = ddp

    def main_hook(self) -> None:
        ddp = self.ddp
        if ddp._rebuild_pending and ddp._order_recorded:
            ddp._rebuild_from_ready_order()
        if ddp.will_sync_module_buffers():
            ddp._sync_buffers(ddp._find_common_rank(ddp.rank, False))
        sync = ddp._check_global_requires_backward_grad_sync(is_joined_rank=True)
        ddp.require_forward_param_sync = sync
        if not sync:
            return
        ddp._match_all_reduce_for_bwd_pass()
        if ddp.find_unused_parameters:
            n = len(ddp._params)
            globally_unused(set(), n, ddp._comm_device, ddp.process_group)

    def post_hook(self, is_last_joiner: bool) -> None:
        self.ddp._sync_final_model(is_last_joiner)


class JoinMixin(Joinable):
    """torch's ``Joinable`` side of DDP (mixed into :class:`dplab.ddp.ddp.DDP`)."""

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """torch's ``ddp.join()``: a ``Join`` context over this DDP alone."""
        return Join(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self._comm_device

    @property
    def join_process_group(self) -> Any:
        return self.process_group

    # -- the collectives both sides issue ------------------------------------------------------

    def _notify_join(self) -> None:
        """At a forward: tell the join context this rank has not joined (an all-reduce of 1s
        that also counts the ranks still training, for the divisor)."""
        self._join_work = Join.notify_join_context(self)

    def _divisor(self) -> int:
        """What this step's buckets are divided by: torch's ``div_factor``."""
        work = getattr(self, "_join_work", None)
        if work is None or getattr(self, "_divide_by_initial_world_size", True):
            return self.world_size
        work.wait()
        return int(work.result()[0].item())

    def _find_common_rank(self, rank: int, candidate: bool) -> int:
        """The highest rank that is a candidate (torch: a MAX all-reduce)."""
        t = torch.tensor([rank if candidate else -1], device=self._comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process_group)
        if t.item() == -1:
            raise ValueError("BUG! Expected rank_cond to be true for at least one process.")
        return int(t.item())

    def _check_global_requires_backward_grad_sync(self, is_joined_rank: bool) -> bool:
        """Whether any rank synchronises this iteration (joined ranks ask; others answer)."""
        wants = not is_joined_rank and self.require_backward_grad_sync
        t = torch.full((1,), 1.0 if wants else 0.0, device=self._comm_device)
        work = dist.all_reduce(t, group=self.process_group, async_op=True)
        if not is_joined_rank:
            return True
        work.wait()
        return bool(work.result()[0].item() != 0)

    def _match_all_reduce_for_bwd_pass(self) -> None:
        """A joined rank's side of the backward: zeros for every bucket, in bucket order."""
        works = []
        n = len(self.bucket_buffers)
        for b, buffer in enumerate(self.bucket_buffers):
            zeros = torch.zeros_like(buffer)
            if self._comm_hook is not None:
                members = self._layout.members[b]
                shapes = [self._params[i][1].shape for i in members]
                params = [self._params[i][1] for i in members]
                bucket = GradBucket(b, n, zeros, self._layout.offsets[b], shapes, params)
                works.append(run_comm_hook(self._comm_hook, self._comm_hook_state, bucket)[0])
            else:
                works.append(dist.all_reduce(zeros, group=self.process_group, async_op=True))
        for work in works:
            work.wait()

    def _sync_final_model(self, is_last_joiner: bool) -> None:
        """The last rank to join (the highest, on a tie) broadcasts parameters and buffers."""
        src = self._find_common_rank(self.rank, is_last_joiner)
        tensors = [p.detach() for _, p in self._kept_parameters()]
        if self.forward_sync_buffers:
            tensors += self._current_buffers()
        if self.world_size > 1:
            broadcast_from(
                tensors, dist.get_global_rank(self.process_group, src), self.process_group
            )
