"""§3 Ragged lengths: a per-rank mean loss over unequal token counts is not the global mean.

DDP averages the ranks' gradients with equal weights, 1/N each. If every rank's loss is the mean
over *its own* tokens, a rank with 3 tokens counts as much as a rank with 30, so each of its
tokens weighs ten times more than the one-big-batch loss would give it. The fix divides each
rank's *sum* by the global token count (one all-reduce of a number) and multiplies by N, which
DDP's 1/N then cancels. The 2024 gradient-accumulation bug in transformers was this mistake
across micro-batches instead of ranks.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from dplab import _checks
from dplab.failures._common import mlp, short_group

WIDTH = 8


def tokens_of(rank: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``count`` tokens (inputs, targets), the same wherever they are drawn."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(count, WIDTH, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin() + 0.1 * torch.randn(count, 1, generator=g)


def _grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@dataclass(frozen=True)
class RaggedLoss:
    """One rank's gradient against the one-big-batch gradient of every rank's tokens.

    ``error`` is the largest difference relative to the largest reference entry.
    """

    normalization: str
    tokens: tuple[int, ...]
    error: float


def ragged_loss(
    normalization: str, *, tokens: tuple[int, ...] = (3, 30), group_timeout_s: float = 5.0
) -> RaggedLoss:
    """Rank function: one DDP backward with ``"per_rank_mean"`` or ``"global_count"`` losses."""
    _checks.check_choice("normalization", normalization, ("per_rank_mean", "global_count"))
    world, rank = dist.get_world_size(), dist.get_rank()
    if len(tokens) != world:
        raise ValueError(f"tokens must give a count for each of the {world} ranks, got {tokens}")
    for count in tokens:
        _checks.check_positive_int("tokens", count)
    reference = mlp(WIDTH, 3)
    with short_group(group_timeout_s) as group:
        model = TorchDDP(copy.deepcopy(reference), process_group=group)
        x, y = tokens_of(rank, tokens[rank])
        per_token = (model(x) - y).pow(2)
        if normalization == "per_rank_mean":
            loss = per_token.mean()
        else:
            count = torch.tensor(float(len(x)))
            dist.all_reduce(count, group=group)  # the global token count
            loss = per_token.sum() / count * world  # DDP's 1/N cancels the * world
        loss.backward()
        replica = model.module
        del model, per_token, loss  # a DDP must not outlive its group (see short_group)
    # The one-big-batch gradient: every rank's tokens in one mean, on one replica.
    big = [tokens_of(r, n) for r, n in enumerate(tokens)]
    xs, ys = torch.cat([b[0] for b in big]), torch.cat([b[1] for b in big])
    (reference(xs) - ys).pow(2).mean().backward()
    ref = _grads(reference)
    error = ((_grads(replica) - ref).abs().max() / ref.abs().max()).item()
    return RaggedLoss(normalization, tuple(tokens), error)
