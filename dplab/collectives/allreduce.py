"""All-reduce on real ranks from point-to-point messages only: the ring and the naive contrast.

Both run in place on the calling rank's tensor, inside a process group (``dplab.launch``).
"""

from __future__ import annotations

from numbers import Integral
from typing import Any

from dplab.collectives.schedule import (
    BROADCAST,
    GATHER,
    REDUCE_SCATTER,
    Transfer,
    chunk_bounds,
    ring_phase,
    ring_recv_chunk,
    ring_send_chunk,
)

OPS = ("sum", "avg", "max", "min")


def group_info(group: Any) -> tuple[int, int, Any]:
    """(this rank within ``group``, the group's size, the group); a clear error off the ranks."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: run this on ranks, e.g. inside a function "
            "passed to dplab.launch(fn, world_size) or dplab.Cluster(world_size).run(fn)"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the given process group")
    return rank, dist.get_world_size(group), group


def _global_rank(group: Any, rank: int) -> int:
    import torch.distributed as dist

    return rank if group is None else dist.get_global_rank(group, rank)


def _check_tensor(tensor: Any, op: str) -> None:
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if op == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(f"op='avg' needs a floating-point tensor, got dtype {tensor.dtype}")
    if op in ("max", "min") and tensor.is_complex():
        raise ValueError(f"op={op!r} is undefined for complex dtype {tensor.dtype}")


def _reduce_into(out: Any, incoming: Any, op: str) -> None:
    import torch

    if op in ("sum", "avg"):
        out.add_(incoming)
    elif op == "max":
        torch.maximum(out, incoming, out=out)
    else:
        torch.minimum(out, incoming, out=out)


def _flat_work(tensor: Any) -> tuple[Any, Any]:
    """A flat contiguous view to work on: the tensor itself, or a copy for a strided tensor."""
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    return work, work.view(-1)


def ring_all_reduce(
    tensor: Any,
    *,
    op: str = "sum",
    group: Any = None,
    record: list[Transfer] | None = None,
    steps: int | None = None,
) -> Any:
    """Ring all-reduce of ``tensor`` in place, from isend/irecv only; returns ``tensor``.

    ``op``: "sum" (as ``dist.all_reduce``), "avg" (sum / N: the gradient average DDP needs),
    "max" or "min". ``record``: a list that receives one :class:`Transfer` per message this rank
    sends (its bytes counted from the tensor actually sent), for the step-through figure.
    ``steps``: stop after that many of the 2(N-1) steps, to look at the half-done buffers (after
    N-1 steps, rank r holds the finished chunk ``(r+1) mod N``: that is a reduce-scatter).

    A non-contiguous tensor is reduced in a contiguous copy and copied back.

    Integers come out equal to ``dist.all_reduce``'s; floats equal up to rounding, because chunk
    c is summed in ring order starting at rank c while gloo adds in its own order (N = 2 is
    bit-identical: one addition commutes). Every rank ends with the same bits.
    """
    import torch
    import torch.distributed as dist

    _check_tensor(tensor, op)
    rank, n, group = group_info(group)
    total = 2 * (n - 1)
    if steps is None:
        steps = total
    elif isinstance(steps, bool) or not isinstance(steps, Integral) or not 0 <= steps <= total:
        raise ValueError(f"steps must be an int in 0..{total} (2(N-1) for N={n}), got {steps!r}")
    work, flat = _flat_work(tensor)
    bounds = chunk_bounds(flat.numel(), n)
    right = _global_rank(group, (rank + 1) % n)
    left = _global_rank(group, (rank - 1) % n)
    for step in range(1, steps + 1):
        phase = ring_phase(step, n)
        sent_c, recv_c = ring_send_chunk(rank, step, n), ring_recv_chunk(rank, step, n)
        outgoing = flat[slice(*bounds[sent_c])]
        target = flat[slice(*bounds[recv_c])]
        # Reduce-scatter must add what arrives to what is there, so it lands in a scratch
        # buffer; all-gather overwrites, so it lands in place.
        incoming = torch.empty_like(target) if phase == REDUCE_SCATTER else target
        works = [
            dist.isend(outgoing, right, group=group),
            dist.irecv(incoming, left, group=group),
        ]
        for w in works:
            w.wait()
        if phase == REDUCE_SCATTER:
            _reduce_into(target, incoming, op)
        if record is not None:
            start, stop = bounds[sent_c]
            nbytes = outgoing.numel() * outgoing.element_size()
            record.append(Transfer(phase, step, rank, (rank + 1) % n, sent_c, start, stop, nbytes))
    if op == "avg" and steps == total:
        flat.div_(n)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def naive_all_reduce(
    tensor: Any,
    *,
    op: str = "sum",
    group: Any = None,
    root: int = 0,
    record: list[Transfer] | None = None,
) -> Any:
    """Gather-to-one then broadcast, in place; returns ``tensor``. The contrast to the ring.

    ``root`` receives every other rank's whole tensor, reduces in rank order, and sends the
    result back to each. Its link moves ``(N-1)·S`` bytes in and ``(N-1)·S`` out.
    """
    import torch.distributed as dist

    _check_tensor(tensor, op)
    rank, n, group = group_info(group)
    if isinstance(root, bool) or not isinstance(root, Integral) or not 0 <= root < n:
        raise ValueError(f"root must be a rank in 0..{n - 1}, got {root!r}")
    work, flat = _flat_work(tensor)
    numel, nbytes = flat.numel(), flat.numel() * flat.element_size()
    others = [r for r in range(n) if r != root]
    if rank == root:
        inbox = {r: flat.new_empty(flat.shape) for r in others}
        works = [dist.irecv(inbox[r], _global_rank(group, r), group=group) for r in others]
        for w in works:
            w.wait()
        # Reduce in rank order whatever the root, so moving the root does not move the bits.
        parts = {**inbox, root: flat}
        acc = flat if root == 0 else parts[0].clone()
        for r in range(1, n):
            _reduce_into(acc, parts[r], op)
        if acc is not flat:
            flat.copy_(acc)
        if op == "avg":
            flat.div_(n)
        works = [dist.isend(flat, _global_rank(group, r), group=group) for r in others]
        for w in works:
            w.wait()
        if record is not None:
            record.extend(Transfer(BROADCAST, 2, root, r, None, 0, numel, nbytes) for r in others)
    else:
        dist.isend(flat, _global_rank(group, root), group=group).wait()
        if record is not None:
            record.append(Transfer(GATHER, 1, rank, root, None, 0, numel, nbytes))
        dist.irecv(flat, _global_rank(group, root), group=group).wait()
    if work is not tensor:
        tensor.copy_(work)
    return tensor
