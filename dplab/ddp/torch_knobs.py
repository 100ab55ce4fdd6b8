"""The knobs of torch's DDP a practitioner reaches for, measured on torch's own DDP on real ranks.

Each function runs on every rank (``dplab.Cluster.run``) and asks torch itself: its
``_get_ddp_logging_data()`` for the buckets, its ``.grad`` storages for memory, its comm hooks'
calls at ``torch.distributed``'s door for the bytes. torch's own DDP is used, not ``dplab.DDP``,
so that every statement the lesson makes is a statement about torch.

- :func:`first_buckets_by_flag`: iteration 0's buckets and the rebuild under the default,
  ``find_unused_parameters=True``, ``static_graph=True`` and ``bucket_cap_mb_list``.
- :func:`grad_view_copies`: ``gradient_as_bucket_view`` with ``zero_grad(set_to_none=...)``.
- :func:`buffer_sync_at_init`: ``broadcast_buffers=False`` against ``forward_sync_buffers=False``.
- :func:`comm_hook_traffic`: bytes sent and gradient error of bf16 compression and PowerSGD.
- :func:`end_of_backward_order`: a ``queue_callback`` runs after every gradient hook, before
  ``backward()`` returns (how a DDP waits for its buckets without the caller's help).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dplab._units import MIB
from dplab.ddp.torch_probe import linear_stack, probe_batch, probe_loss, torch_logging

DDPT = nn.parallel.DistributedDataParallel

# The flag sets the lesson compares, by label (torch's own argument names).
FLAG_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    "find_unused_parameters=True": {"find_unused_parameters": True},
    "static_graph=True": {"static_graph": True},
    "bucket_cap_mb_list=[1, 2]": {"bucket_cap_mb_list": [1, 2]},
}


@dataclass
class FirstBuckets:
    """torch's buckets under one flag set, from its own logging.

    ``initial``: ``bucket_sizes`` after step 0 (the buckets iteration 0 reduced with);
    ``rebuilt``: ``rebuilt_bucket_sizes`` after the last step (``[]`` if it never rebuilt);
    ``rebuilt_from_step``: the first step that ran on rebuilt buckets (None: none did);
    ``registration_cut``: torch's own ``_compute_bucket_assignment_by_size`` over registration
    order with caps [1 MiB, 25 MiB], reversed as torch's DDP reverses it (bytes per bucket);
    ``warnings``: what torch warned on this rank while it ran.
    """

    flags: str
    initial: list[int]
    rebuilt: list[int]
    has_rebuilt: int
    rebuilt_from_step: int | None
    registration_cut: list[int]
    warnings: list[str]


def _registration_cut(model: nn.Module) -> list[int]:
    params = list(model.parameters())
    caps = [dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * MIB]
    cut, _ = dist._compute_bucket_assignment_by_size(params, caps, [False] * len(params))
    return [sum(params[i].numel() * params[i].element_size() for i in b) for b in cut[::-1]]


def first_buckets_by_flag(
    flags: str, *, width: int = 256, depth: int = 6, steps: int = 4, batch: int = 8
) -> FirstBuckets:
    """torch DDP under ``FLAG_SETS[flags]`` on ``depth`` × Linear(``width``), ``steps`` steps.

    Every parameter is used, so ``find_unused_parameters=True`` makes torch warn that it found
    none (its graph search each step bought nothing); the warning is returned, not shown.
    """
    if flags not in FLAG_SETS:
        raise ValueError(f"flags must be one of {list(FLAG_SETS)}, got {flags!r}")
    rank = dist.get_rank()
    model = linear_stack(width, depth)
    cut = _registration_cut(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp = DDPT(model, **FLAG_SETS[flags])
        logs = []
        for step in range(steps):
            ddp.zero_grad()
            probe_loss(ddp, probe_batch(width, batch, 1000 * step + rank)).backward()
            logs.append(torch_logging(ddp))
    return FirstBuckets(
        flags=flags,
        initial=logs[0]["bucket_sizes"],
        rebuilt=logs[-1]["rebuilt_bucket_sizes"],
        has_rebuilt=int(logs[-1]["has_rebuilt_buckets"]),
        rebuilt_from_step=next(
            (k for k, log in enumerate(logs) if log["has_rebuilt_buckets"]), None
        ),
        registration_cut=cut,
        warnings=sorted({str(w.message).split(".")[0] for w in caught}),
    )


@dataclass
class GradViewRun:
    """torch DDP with one ``gradient_as_bucket_view`` / ``zero_grad(set_to_none=)`` pair.

    ``in_bucket[k]``: how many gradients, in step k + 2 (after the rebuild), AccumulateGrad
    wrote straight into a bucket (no allocation, no copy into it); ``n_grads`` of them in all.
    ``after_backward`` / ``after_zero_grad``: bytes of distinct storages among the ``.grad``
    tensors and torch's bucket buffers at those moments of the last step; ``grad_bytes``: one
    copy of the gradients.
    """

    view: bool
    set_to_none: bool
    in_bucket: list[int]
    n_grads: int
    after_backward: int
    after_zero_grad: int
    grad_bytes: int


def grad_view_copies(
    view: bool, set_to_none: bool, *, width: int = 256, depth: int = 6, steps: int = 4
) -> GradViewRun:
    """Train ``steps`` steps (SGD); see where each gradient lands and what memory is held.

    torch's buckets are read through a comm hook that records each bucket's buffer and then
    all-reduces it as torch's default hook does; a post-accumulate-grad hook (it runs inside
    AccumulateGrad, before the reducer's own hook) sees where the gradient was written.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    rank = dist.get_rank()
    model = linear_stack(width, depth)
    buckets: dict[int, int] = {}  # storage pointer -> bytes

    def recording_hook(state, bucket):  # type: ignore[no-untyped-def]  # torch reads the
        # annotations, and a postponed one (a string) fails its check: none at all passes
        buf = bucket.buffer()
        buckets[buf.untyped_storage().data_ptr()] = buf.untyped_storage().nbytes()
        return allreduce_hook(state, bucket)

    ddp = DDPT(model, gradient_as_bucket_view=view)
    ddp.register_comm_hook(None, recording_hook)
    hits: list[int] = []
    last: dict[int, int] = {}  # the previous step's buckets (the rebuild replaces step 0's)

    def seen(p: torch.Tensor) -> None:
        hits[-1] += int(p.grad.untyped_storage().data_ptr() in last)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(seen)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    after_backward = after_zero = 0
    for step in range(steps):
        hits.append(0)
        buckets.clear()
        probe_loss(ddp, probe_batch(width, 8, 1000 * step + rank)).backward()
        last = dict(buckets)
        after_backward = _held_bytes(model, last)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        after_zero = _held_bytes(model, last)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return GradViewRun(
        view, set_to_none, hits[2:], len(list(model.parameters())), after_backward, after_zero,
        grad_bytes,
    )  # fmt: skip


def _held_bytes(model: nn.Module, buckets: dict[int, int]) -> int:
    held = dict(buckets)
    for p in model.parameters():
        if p.grad is not None:
            held[p.grad.untyped_storage().data_ptr()] = p.grad.untyped_storage().nbytes()
    return sum(held.values())


@dataclass
class BufferSync:
    """Right after ``DDP(...)`` is built on ranks whose BatchNorm running means differ.

    ``equal_after_init[label]``: every rank holds rank 0's running mean; ``warned[label]``:
    the first line of torch's FutureWarning, if any.
    """

    equal_after_init: dict[str, bool]
    warned: dict[str, str]


def buffer_sync_at_init(*, width: int = 16) -> BufferSync:
    """Build torch DDP with ``broadcast_buffers=False`` and with ``forward_sync_buffers=False``."""
    equal, warned = {}, {}
    for label, kwargs in (
        ("broadcast_buffers=False", {"broadcast_buffers": False}),
        ("forward_sync_buffers=False", {"forward_sync_buffers": False}),
    ):
        model = linear_stack(width, 2, batchnorm=True)
        bn = next(m for m in model.modules() if isinstance(m, nn.BatchNorm1d))
        with torch.no_grad():
            bn.running_mean.fill_(float(dist.get_rank() + 1))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            DDPT(model, **kwargs)
        gathered = [torch.zeros_like(bn.running_mean) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, bn.running_mean.clone())
        equal[label] = all(torch.equal(g, gathered[0]) for g in gathered)
        future = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
        warned[label] = future[0].split(". ")[0] if future else ""
    return BufferSync(equal, warned)


@dataclass
class CommHookTraffic:
    """One comm hook on torch DDP: per step, bytes handed to ``all_reduce`` and the error.

    ``sent[k]``: bytes this rank passed to ``torch.distributed.all_reduce`` in step k;
    ``rel_error[k]``: ‖g − ḡ‖ / ‖ḡ‖ over all gradients, ḡ the exact average (torch DDP without
    a hook on the same weights and batch); ``grad_bytes``: the fp32 gradients' bytes;
    ``refused``: torch's own message where it refuses the hook on this backend (then no steps).
    """

    hook: str
    sent: list[int]
    rel_error: list[float]
    grad_bytes: int
    refused: str = ""


HOOKS = ("allreduce", "fp16_compress", "bf16_compress", "powerSGD rank 1")


def _make_hook(name: str) -> tuple[Any, Callable[..., Any]]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as d
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as p

    if name == "allreduce":
        return None, d.allreduce_hook
    if name == "fp16_compress":
        return None, d.fp16_compress_hook
    if name == "bf16_compress":
        return None, d.bf16_compress_hook
    if name == "powerSGD rank 1":  # plain all-reduce for 2 steps, then rank-1 factors
        state = p.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        return state, p.powerSGD_hook
    raise ValueError(f"hook must be one of {list(HOOKS)}, got {name!r}")


def comm_hook_traffic(
    hook: str, counter: Callable[[], Any], *, width: int = 256, depth: int = 4, steps: int = 4
) -> CommHookTraffic:
    """torch DDP with ``hook`` beside one without, same weights and batches, no optimizer step.

    ``counter`` makes a collective counter (pass ``dplab.mechanics.CommCounter``; it lives in a
    higher layer). torch's hookless DDP all-reduces in C++, out of its sight: it only gives ḡ.
    """
    rank = dist.get_rank()
    state, fn = _make_hook(hook)
    hooked, exact = DDPT(linear_stack(width, depth)), DDPT(linear_stack(width, depth))
    sent: list[int] = []
    errors: list[float] = []
    grad_bytes = sum(q.numel() * q.element_size() for q in exact.module.parameters())
    try:
        hooked.register_comm_hook(state, fn)
    except TypeError as e:  # bf16 on gloo: torch says what it needs
        return CommHookTraffic(hook, sent, errors, grad_bytes, refused=str(e))
    with counter() as count:
        for step in range(steps):
            x = probe_batch(width, 8, 1000 * step + rank)
            for net in (hooked, exact):
                net.zero_grad()
                with count.phase(f"step {step}" if net is hooked else "-"):
                    probe_loss(net, x).backward()
            sent.append(count.nbytes("all_reduce", f"step {step}"))
            g = torch.cat([q.grad.flatten() for q in hooked.module.parameters()])
            e = torch.cat([q.grad.flatten() for q in exact.module.parameters()])
            errors.append(float((g - e).norm() / e.norm()))
    return CommHookTraffic(hook, sent, errors, grad_bytes)


@dataclass
class EndOfBackward:
    """The order of events in one backward through torch DDP, on this rank's clock (seconds).

    ``last_grad_hook``: the last post-accumulate-grad hook; ``callback``: a function queued
    with ``queue_callback`` from the first gradient hook; ``returned``: ``backward()`` returned.
    ``averaged_on_return``: every ``.grad`` was already the average over the ranks (equal to
    this rank's own gradient all-reduced and halved by hand) when ``backward()`` returned, with
    no call from the caller: torch's reducer waited for its buckets in a callback it queued.
    """

    last_grad_hook: float
    callback: float
    returned: float
    averaged_on_return: bool


def end_of_backward_order(*, width: int = 64, depth: int = 3) -> EndOfBackward:
    """One backward through torch DDP with our hooks and a ``queue_callback`` beside its own."""
    model = linear_stack(width, depth)
    local = linear_stack(width, depth)
    ddp = DDPT(model)
    x = probe_batch(width, 8, dist.get_rank())
    probe_loss(local, x).backward()  # this rank's own gradient, averaged by hand below
    times: dict[str, float] = {}

    def at_end() -> None:
        times["callback"] = time.perf_counter()

    def on_grad(p: torch.Tensor) -> None:
        if not times:
            torch.autograd.Variable._execution_engine.queue_callback(at_end)
        times["last_grad_hook"] = time.perf_counter()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(on_grad)
    probe_loss(ddp, x).backward()
    times["returned"] = time.perf_counter()
    averaged = True
    for p, q in zip(model.parameters(), local.parameters(), strict=True):
        by_hand = q.grad.clone()
        dist.all_reduce(by_hand)
        averaged &= torch.equal(p.grad, by_hand / dist.get_world_size())
    return EndOfBackward(times["last_grad_hook"], times["callback"], times["returned"], averaged)
