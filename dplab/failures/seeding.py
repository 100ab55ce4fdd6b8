"""One seed on every rank: the replicas agree, and so does every rank's "random" augmentation.

``torch.manual_seed(seed)`` at the top of a training script, run by every rank, gives every rank
the same random stream. DDP needs equal *weights* (it broadcasts rank 0's anyway), but the data
pipeline's random draws (crops, flips, noise, dropout masks) are then the same on every rank:
each rank flips the same positions of its batch, so N ranks see one augmentation pattern where
one process on the whole batch would have drawn N. The fix seeds the data's randomness per rank
(``seed + rank``; for ``DataLoader`` workers, a ``generator`` or ``worker_init_fn`` seeded by
rank) and leaves the model's initial weights to DDP's broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from dplab.failures._common import every_rank, mlp, replica_digest, short_group


@dataclass(frozen=True)
class SeedRun:
    """What one rank's pipeline drew (flip decisions per sample, each step), whether every rank
    drew the same, and whether the replicas stayed equal."""

    per_rank_seed: bool
    flips: tuple[tuple[bool, ...], ...]
    same_on_every_rank: bool
    replicas_equal: bool


def augmentations_seen(
    *, per_rank_seed: bool, steps: int = 3, batch: int = 8, group_timeout_s: float = 5.0
) -> SeedRun:
    """Rank function: ``steps`` DDP steps on this rank's shard, each sample flipped at random."""
    rank = dist.get_rank()
    torch.manual_seed(0)  # the script's seed, on every rank: the model starts equal
    model = mlp(width=8, depth=2)
    if per_rank_seed:
        torch.manual_seed(1000 + rank)  # the fix: the data's randomness differs by rank
    flips = []
    with short_group(group_timeout_s) as group:
        ddp = TorchDDP(model, process_group=group)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(steps):
            x = torch.arange(batch * 8, dtype=torch.float32).reshape(batch, 8) / 64 + rank + step
            flip = torch.rand(batch) < 0.5  # the augmentation: flip these samples
            x[flip] = x[flip].flip(1)
            flips.append(tuple(flip.tolist()))
            opt.zero_grad()
            ddp(x).pow(2).mean().backward()
            opt.step()
        seen = every_rank(tuple(flips), group)
        digests = every_rank(replica_digest(model), group)
        del ddp  # a DDP must not outlive its group (see short_group)
    return SeedRun(per_rank_seed, tuple(flips), len(set(seen)) == 1, len(set(digests)) == 1)
