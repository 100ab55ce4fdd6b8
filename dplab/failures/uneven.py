"""§4 Uneven inputs: one rank runs out of batches, and the others wait in an all-reduce forever.

Every backward of a DDP model issues one all-reduce per bucket on every rank. A rank whose data
ended one batch early issues none for that step, so its partners wait for it inside the
collective. dplab's pool counts each rank's collectives: when a rank has *returned* and another
has issued more, they can never meet, and the pool says so at once (the course's desync
message). torch's fix is ``Join``: a rank that ran out keeps *shadowing* the collectives the
others still make (it all-reduces zeros), so the others finish their extra batches. dplab.DDP
does not implement ``join()`` (it refuses it), so the fix runs on torch's DDP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from dplab.ddp import DDP
from dplab.failures._common import every_rank, mlp, replica_digest, short_group


def batches_of(rank: int, short_rank: int = 1, batches: int = 3) -> int:
    """How many batches ``rank`` gets: one fewer on ``short_rank``."""
    return batches - 1 if rank == short_rank else batches


def _train(model: torch.nn.Module, count: int, rank: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(count):
        torch.manual_seed(100 * rank + step)
        model(torch.randn(4, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def uneven_without_join(batches: int = 3) -> int:
    """Rank function (the bug): dplab.DDP on the pool's group, rank 1 one batch short.

    Rank 1 returns after its last batch while rank 0 waits in the next all-reduce: run it with
    ``dplab.launch(..., group_timeout_s=...)``; the pool raises its desync error within a poll.
    """
    rank = dist.get_rank()
    count = batches_of(rank, batches=batches)
    _train(DDP(mlp(16, 3)), count, rank)
    return count


@dataclass(frozen=True)
class JoinRun:
    """One rank's uneven run under torch's ``Join``: batches it trained, every replica's digest."""

    batches: int
    digests: tuple[str, ...]

    @property
    def replicas_equal(self) -> bool:
        return len(set(self.digests)) == 1


def uneven_with_join(batches: int = 3, *, group_timeout_s: float = 5.0) -> JoinRun:
    """Rank function (the fix): the same uneven data under ``with Join([model])``."""
    rank = dist.get_rank()
    count = batches_of(rank, batches=batches)
    with short_group(group_timeout_s) as group:
        model = TorchDDP(mlp(16, 3), process_group=group)
        with Join([model]):
            _train(model, count, rank)
        digests = tuple(every_rank(replica_digest(model.module), group))
        del model  # a DDP must not outlive its group (see short_group)
    return JoinRun(count, digests)
