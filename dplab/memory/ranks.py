"""Rank functions: every rank of a real data-parallel job measures what it holds.

Launched with :func:`dplab.launch`, each rank builds the same model, wraps it in a DDP, trains one
step on its own shard of the batch and measures its model state (see
:mod:`dplab.memory.measure`). Plain DP gives every rank the same bytes whatever the world size;
that is the memory wall, measured.

DDP's all-reduce buckets are reported apart from the model state. torch's DDP keeps one flat
buffer per bucket inside its C++ reducer; a communication hook sees each bucket's buffer
(``GradBucket.buffer()``), which is how the bytes are found here. With
``gradient_as_bucket_view=True`` each ``.grad`` is a view into its bucket's buffer, so the
buckets cost nothing extra; without it they are a second copy of every gradient.
"""

from __future__ import annotations

from typing import Any

import torch

from dplab.memory.gpt import measured_gpt, random_batch
from dplab.memory.measure import held_tensors, make_recipe, storage_bytes_by_part, train_step
from dplab.memory.recipes import PARTS


def _wrap_torch_ddp(
    model, *, gradient_as_bucket_view: bool, bucket_cap_mb: float, buffers: dict, process_group
):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(
        model,
        process_group=process_group,
        gradient_as_bucket_view=gradient_as_bucket_view,
        bucket_cap_mb=bucket_cap_mb,
    )

    # No annotations: DDP checks a hook's annotations, and this module's are postponed strings.
    def record_then_allreduce(state, bucket):
        buffers[bucket.index()] = bucket.buffer()  # the reducer's own flat buffer, not a copy
        return allreduce_hook(process_group, bucket)

    ddp.register_comm_hook(None, record_then_allreduce)
    return ddp


def rank_state(
    precision: str = "mixed",
    optimizer: str = "adam",
    *,
    model_kwargs: dict[str, Any] | None = None,
    micro_batch: int = 2,
    seq_len: int = 32,
    ddp: str = "torch",
    gradient_as_bucket_view: bool = False,
    bucket_cap_mb: float = 25.0,
    zero1: bool = False,
    group_size: int | None = None,
) -> dict[str, Any] | None:
    """Run on every rank: build, wrap, one step, measure. Returns a plain dict.

    ``ddp`` is ``"torch"`` (``DistributedDataParallel``) or ``"dplab"`` (``dplab.DDP``, whose
    ``.bucket_buffers`` are its flat buckets). ``zero1=True`` replaces the optimizer by torch's
    ``ZeroRedundancyOptimizer`` (fp32 AdamW, optimizer state sharded across ranks: ZeRO stage 1).

    ``group_size=n`` runs the data-parallel job on the first ``n`` ranks only (a process group of
    its own; the other ranks return ``None``), so that one warm :class:`dplab.Cluster` can measure
    several world sizes without starting processes again.
    """
    import torch.distributed as dist

    import dplab

    rank = dist.get_rank()
    group, world = sub_group(group_size)
    if rank >= world:
        return None
    device = dplab.device()
    torch.manual_seed(0)
    model = measured_gpt(**(model_kwargs or {})).to(device)
    model, opt = _optimizer(model, precision, optimizer, zero1, group)
    bucket_buffers: dict[int, torch.Tensor] = {}
    wrapped = _wrap(model, ddp, gradient_as_bucket_view, bucket_cap_mb, bucket_buffers, group)

    x, y = random_batch(model.vocab, micro_batch, seq_len, seed=rank, device=device)
    train_step(wrapped, opt, [(x, y)])

    if ddp == "dplab":
        bucket_buffers = dict(enumerate(wrapped.bucket_buffers))
    held = held_tensors(model, opt)
    parts = storage_bytes_by_part({**held, "ddp_buckets": list(bucket_buffers.values())})
    n_params = sum(p.numel() for p in model.parameters())
    state = sum(parts[p] for p in PARTS)
    bucket_total = storage_bytes_by_part({"b": list(bucket_buffers.values())})["b"]
    return {
        "rank": rank,
        "world_size": world,
        "n_params": n_params,
        "parts": {p: parts[p] for p in (*PARTS, "buffers")},
        "state_bytes": state,
        "bytes_per_param": state / n_params,
        "ddp": ddp,
        "gradient_as_bucket_view": gradient_as_bucket_view,
        "zero1": zero1,
        "buckets": len(bucket_buffers),
        "bucket_bytes": bucket_total,
        # bucket bytes not already counted as gradients: what the buckets add to the state
        "bucket_extra_bytes": parts["ddp_buckets"],
    }


def sub_group(group_size: int | None) -> tuple[Any, int]:
    """The process group of the first ``group_size`` ranks (None: the default group) and its
    size. Every rank must call it: creating a group is itself a collective."""
    import torch.distributed as dist

    world = dist.get_world_size()
    if group_size is None:
        return None, world
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise ValueError(f"group_size must be an int, got {group_size!r}")
    if not 1 <= group_size <= world:
        raise ValueError(f"group_size must be in 1..{world}, got {group_size!r}")
    return dist.new_group(list(range(group_size))), group_size


def _optimizer(
    model: torch.nn.Module, precision: str, optimizer: str, zero1: bool, group: Any
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The recipe's model and optimizer, or fp32 AdamW sharded by ZeroRedundancyOptimizer."""
    if not zero1:
        return make_recipe(model, precision, optimizer)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if precision != "fp32" or optimizer != "adam":
        raise ValueError("zero1=True measures fp32 AdamW only")
    model = model.float()
    opt = ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3, process_group=group
    )
    return model, opt


def _wrap(
    model: torch.nn.Module, ddp: str, gradient_as_bucket_view: bool, bucket_cap_mb: float,
    bucket_buffers: dict[int, torch.Tensor], group: Any,
) -> torch.nn.Module:  # fmt: skip
    """``model`` in torch's DDP (its bucket buffers collected into ``bucket_buffers``) or in
    dplab.DDP."""
    import dplab

    if ddp == "torch":
        return _wrap_torch_ddp(
            model,
            gradient_as_bucket_view=gradient_as_bucket_view,
            bucket_cap_mb=bucket_cap_mb,
            buffers=bucket_buffers,
            process_group=group,
        )
    if ddp == "dplab":
        return dplab.DDP(
            model,
            bucket_cap_mb=bucket_cap_mb,
            process_group=group,
            gradient_as_bucket_view=gradient_as_bucket_view,
        )
    raise ValueError(f"ddp must be 'torch' or 'dplab', got {ddp!r}")
