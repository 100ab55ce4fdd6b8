"""§8 Two forwards before one backward, with BatchNorm buffers (the GAN pattern).

A discriminator runs on real and on fake images, then one backward through both. Under torch's
DDP with ``forward_sync_buffers=True`` (the default) each forward first copies rank 0's BatchNorm
buffers (running mean and variance) into every rank. Older torch (and cuDNN's batch norm, which
saves the running statistics for backward) failed here with "one of the variables needed for
gradient computation has been modified by an inplace operation"; the lesson runs what *this*
torch does. ``forward_sync_buffers=False`` stops the copies at forward: every rank keeps its own
running statistics, which drift apart (evaluation then differs by rank unless they are
synchronised, or SyncBatchNorm is used). torch 2.13 deprecates the older name,
``broadcast_buffers``, for it (``DistributedDataParallel.__init__``): ``broadcast_buffers=False``
also skipped the buffers' broadcast at construction, ``forward_sync_buffers=False`` does not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from dplab.failures._common import every_rank, short_group


@dataclass(frozen=True)
class TwoForwards:
    """One rank's run: torch's error (None if none), and whether the ranks' BatchNorm running
    means agreed when the second forward began (what ``forward_sync_buffers`` decides)."""

    forward_sync_buffers: bool
    error: str | None
    buffers_equal: bool


def two_forwards(*, forward_sync_buffers: bool, group_timeout_s: float = 5.0) -> TwoForwards:
    """Rank function: D(real) and D(fake), one backward through both, under torch's DDP."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    error = None
    with short_group(group_timeout_s) as group:
        model = TorchDDP(net, process_group=group, forward_sync_buffers=forward_sync_buffers)
        torch.manual_seed(rank + 1)  # each rank its own real and fake batches
        real, fake = torch.randn(16, 8), torch.randn(16, 8) + 2.0
        seen: list[torch.Tensor] = []  # the running mean each forward starts from
        net[1].register_forward_pre_hook(lambda m, _: seen.append(m.running_mean.clone()))
        try:
            (model(real).mean() - model(fake).mean()).backward()
        except RuntimeError as e:
            error = str(e)
        means = every_rank(seen[1], group)
        del model  # a DDP must not outlive its group (see short_group)
    return TwoForwards(forward_sync_buffers, error, all(torch.equal(means[0], m) for m in means))
