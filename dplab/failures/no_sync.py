"""§2 ``no_sync`` misuse: DDP reads the flag at *forward*, and one micro-batch must sync: the last.

``no_sync()`` sets ``require_backward_grad_sync = False``; the forward reads it and decides
whether this backward's hooks all-reduce. So a ``no_sync`` around ``backward()`` only changes
nothing: every micro-batch still all-reduces (correct gradients, k times the traffic). And a
loop that lets the *first* micro-batch sync instead of the last all-reduces a partial gradient,
then adds local ones on top: each rank steps with a different gradient and the replicas drift
apart, silently. Comparing a digest of every replica's weights catches it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from dplab import _checks
from dplab.failures._common import every_rank, mlp, replica_digest, short_group

PLACEMENTS = ("around_backward", "around_forward_and_backward", "first_syncs", "last_syncs")


@dataclass(frozen=True)
class NoSyncRun:
    """One rank's optimizer steps of ``micro_batches`` micro-batches each.

    ``allreduces``: bucket all-reduces issued over the run (counted by a comm hook);
    ``digests``: every rank's weight digest at the end, by rank.
    """

    placement: str
    steps: int
    micro_batches: int
    buckets: int
    allreduces: int
    digests: tuple[str, ...]

    @property
    def allreduces_per_step(self) -> float:
        return self.allreduces / self.steps

    @property
    def replicas_equal(self) -> bool:
        return len(set(self.digests)) == 1


def _counting_allreduce(counter: list[int], group: object):
    """torch's default comm hook (average by all-reduce), counting its calls."""

    # No annotations: torch compares them with dist.GradBucket, and this module's are strings.
    def hook(state, bucket):
        counter[0] += 1
        buffer = bucket.buffer().div_(dist.get_world_size(group))
        work = dist.all_reduce(buffer, group=group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    return hook


def no_sync_run(
    placement: str, *, steps: int = 2, micro_batches: int = 4, group_timeout_s: float = 5.0
) -> NoSyncRun:
    """Rank function: gradient accumulation with ``no_sync`` placed as ``placement`` says.

    - ``around_backward``: ``with no_sync(): loss.backward()`` for all but the last (the bug);
    - ``around_forward_and_backward``: forward and backward inside it (the fix);
    - ``first_syncs``: micro-batch 0 outside ``no_sync``, the rest inside (off by one: the bug);
    - ``last_syncs``: the last micro-batch outside ``no_sync`` (the fix).
    """
    _checks.check_choice("placement", placement, PLACEMENTS)
    steps = _checks.check_positive_int("steps", steps)
    micro_batches = _checks.check_positive_int("micro_batches", micro_batches)
    rank = dist.get_rank()
    with short_group(group_timeout_s) as group:
        model = TorchDDP(mlp(16, 3), process_group=group)
        counter = [0]
        model.register_comm_hook(None, _counting_allreduce(counter, group))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(steps):
            for m in range(micro_batches):
                torch.manual_seed(1000 * step + 10 * m + rank)  # each rank its own data
                x = torch.randn(4, 16)
                syncs = m == (0 if placement == "first_syncs" else micro_batches - 1)
                skip = contextlib.nullcontext() if syncs else model.no_sync()
                if placement == "around_backward":
                    loss = model(x).pow(2).mean()
                    with skip:
                        loss.backward()
                else:
                    with skip:
                        model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        buckets = len(model.reducer._get_zeros_like_grad_buckets())
        digests = tuple(every_rank(replica_digest(model.module), group))
        del model, skip, opt  # a DDP must not outlive its group (see short_group)
    return NoSyncRun(placement, steps, micro_batches, buckets, counter[0], digests)
