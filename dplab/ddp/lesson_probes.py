"""The probes lessons 08 and 08b run on the ranks, and the readings they take of a step.

Each probe runs on every rank (``dplab.Cluster.run``) and times or inspects what a DDP did from
outside it: its own hooks registered before the DDP's, a wrapper around
``torch.distributed.all_reduce``, a plain copy of the model. A DDP that reported its own timing
could not be caught launching late; these watch it instead.

- :func:`average_by_hand`: the DDP's ``.grad`` against each rank's own gradient averaged by hand.
- :func:`launch_delays`: how long after its last gradient each bucket's all-reduce was launched.
- :func:`comms_bound_steps`: traced steps of a model whose gradient is large for its compute.
- :func:`core_share`: how much of a core a rank gets, to tell whether another process competes.
- :func:`overlapping_ready`, :func:`backward_slack_ms`, :func:`summed_comm_ms`,
  :func:`buckets_with_room`: readings of a traced ``StepTrace``.
- :func:`rebuild_on_rank`, :func:`rebuild_two_orders`: the rebuild's order, seen by the ranks.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dplab.ddp.ddp import DDP
from dplab.launch import device as rank_device
from dplab.models import make_batch, make_model
from dplab.trace import StepTrace, Tracer


def average_by_hand(model: str, cap_mb: float) -> tuple[int, float]:
    """One backward through ``dplab.DDP`` at ``cap_mb`` (first bucket too) and through a plain
    copy; return (buckets, largest relative difference of DDP's ``.grad`` from the plain
    gradient all-reduced and divided by the world size tensor by tensor)."""
    dev = rank_device()
    net, plain = make_model(model).to(dev), make_model(model).to(dev)
    plain.load_state_dict(net.state_dict())
    ddp = DDP(net, bucket_cap_mb=cap_mb, first_bucket_cap_mb=cap_mb)
    x, y = make_batch(model, 4, seed=dist.get_rank())
    ddp(x.to(dev), y.to(dev)).backward()
    plain(x.to(dev), y.to(dev)).backward()
    worst = 0.0
    for p, q in zip(net.parameters(), plain.parameters(), strict=True):
        average = q.grad.clone()
        dist.all_reduce(average)
        average /= dist.get_world_size()
        worst = max(worst, float((p.grad - average).abs().max() / average.abs().max()))
    return len(ddp.buckets), worst


@contextlib.contextmanager
def _timed_all_reduce(launches: list[float]) -> Iterator[None]:
    """Note the moment of every ``dist.all_reduce`` call in the block (restored afterwards)."""
    original = dist.all_reduce

    def timed(*args: Any, **kwargs: Any) -> Any:
        launches.append(time.perf_counter())
        return original(*args, **kwargs)

    dist.all_reduce = timed
    try:
        yield
    finally:
        dist.all_reduce = original


def launch_delays(model: str, cap_mb: float, steps: int = 3) -> list[list[tuple[float, ...]]]:
    """Per step, per bucket: (first gradient in, last gradient in, all-reduce launched), in s.

    The gradients are timed by this function's own hook on every parameter, registered before
    the DDP's (so it runs first); the launches by a wrapper around ``dist.all_reduce``.
    """
    dev, seen = rank_device(), {}
    net = make_model(model).to(dev)

    def note(name: str) -> Any:
        def hook(param: torch.Tensor) -> None:
            seen.setdefault(name, time.perf_counter())

        return hook

    for name, p in net.named_parameters():
        p.register_post_accumulate_grad_hook(note(name))
    ddp = DDP(net, bucket_cap_mb=cap_mb, first_bucket_cap_mb=cap_mb)
    launches: list[float] = []
    rows = []
    with _timed_all_reduce(launches):
        for step in range(steps):
            seen.clear()
            launches.clear()
            x, y = make_batch(model, 4, seed=step + 10 * dist.get_rank())
            ddp(x.to(dev), y.to(dev)).backward()
            rows.append(
                [
                    (min(seen[n] for n in b.param_names), max(seen[n] for n in b.param_names), t)
                    for b, t in zip(ddp.buckets, launches, strict=False)
                ]
            )
    return rows


def comms_bound_steps(
    width: int = 1024, layers: int = 6, rows: int = 8, steps: int = 4
) -> list[StepTrace]:
    """``layers`` × Linear(width), one bucket per layer, ``rows`` rows per rank: traced steps.

    Each step is two micro-batches: the first under ``no_sync`` (a backward with no all-reduce
    beside it, the compute alone), the second synchronised; one warm-up step is not traced.
    """
    torch.manual_seed(0)
    dev = rank_device()
    net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(dev)
    tracer = Tracer()
    cap = width * width * 4 / 2**20  # one weight's MiB: a layer's bias and weight close a bucket
    ddp = DDP(net, bucket_cap_mb=cap, first_bucket_cap_mb=cap, tracer=tracer)
    opt = tracer.watch(torch.optim.SGD(ddp.parameters(), lr=1e-3))
    for step in range(1 + steps):
        if step == 1:
            tracer.clear()
        with ddp.no_sync():
            ddp(torch.randn(rows, width, device=dev)).square().mean().backward()
        ddp(torch.randn(rows, width, device=dev)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    return list(tracer.steps)


def core_share(seconds: float = 0.3) -> float:
    """Spin this rank's thread for ``seconds``; return the share of that time it held a core
    (thread CPU time over wall time).

    Lesson 08 measures how gloo's threads slow backward by taking the ranks' cores. That is
    readable only where the ranks have the cores to themselves (a share near 1 on every rank);
    another busy process takes its own share and its contention hides gloo's.
    """
    if not seconds > 0:
        raise ValueError(f"seconds must be > 0, got {seconds!r}")
    start, cpu = time.perf_counter(), time.thread_time()
    while time.perf_counter() - start < seconds:
        pass
    return (time.thread_time() - cpu) / (time.perf_counter() - start)


def overlapping_ready(step: StepTrace) -> list[tuple[int, int, float]]:
    """(b, k, ms): bucket k became ready while bucket b < k's all-reduce was in flight, ms
    before that all-reduce ended: backward computing beside communication, by definition."""
    ready = {s.bucket: s.start_ms for s in step.of("bucket_ready")}
    return [
        (c.bucket, k, c.end_ms - t)
        for c in step.of("allreduce")
        for k, t in ready.items()
        if c.bucket < k and c.start_ms < t < c.end_ms
    ]


def backward_slack_ms(step: StepTrace) -> dict[int, float]:
    """Per bucket: the backward time left when its last gradient came in (ms)."""
    end = max(s.end_ms for s in step.of("backward"))
    return {s.bucket: end - s.start_ms for s in step.of("bucket_ready")}


def summed_comm_ms(step: StepTrace) -> float:
    """S: every all-reduce's time added up, as if one ran after another (ms)."""
    return sum(s.end_ms - s.start_ms for s in step.of("allreduce"))


def buckets_with_room(step: StepTrace) -> list[int]:
    """The buckets ready at least S (:func:`summed_comm_ms`) before backward's end: each must
    finish before backward does even if it waits for every other all-reduce."""
    room = summed_comm_ms(step)
    return [b for b, left in backward_slack_ms(step).items() if left >= room]


def rebuild_on_rank(model: str, cap_mb: float) -> dict[str, list[Any]]:
    """dplab.DDP at torch's rule (a cap, nothing else), two steps: its buckets before and after
    the rebuild, and the order the gradients really arrived in step 0 (a hook per parameter)."""
    dev = rank_device()
    net = make_model(model).to(dev)
    ddp = DDP(net, bucket_cap_mb=cap_mb)
    arrived: list[str] = []
    hooks = [
        p.register_post_accumulate_grad_hook(lambda p, n=n: arrived.append(n))
        for n, p in net.named_parameters()
    ]
    before = [list(b.param_names) for b in ddp.buckets]
    first_order: list[str] = []
    for step in range(2):
        x, y = make_batch(model, 4, seed=10 * step + dist.get_rank())
        ddp(x.to(dev), y.to(dev)).backward()
        if step == 0:
            first_order = list(arrived)
            for h in hooks:
                h.remove()
    after = [list(b.param_names) for b in ddp.buckets]
    return {"before": before, "after": after, "arrived": first_order}


class TwoBranches(nn.Module):
    """Two Linear(64, 64) branches whose order in ``forward`` is the caller's choice: the order
    they run in decides the order autograd hands out their gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, b_first: bool) -> torch.Tensor:
        if b_first:
            yb = self.b(x)
            ya = self.a(x)
        else:
            ya = self.a(x)
            yb = self.b(x)
        return (ya * yb).sum()


def rebuild_two_orders() -> dict[str, list[Any]]:
    """dplab.DDP on :class:`TwoBranches`, rank 1 running ``b`` first: each rank's arrival order
    in step 0 and its buckets after the rebuild (caps small enough for one weight per bucket)."""
    net = TwoBranches()
    arrived: list[str] = []
    for n, p in net.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: arrived.append(n))
    ddp = DDP(net, bucket_cap_mb=64 * 64 * 4 / 2**20)
    for _ in range(2):
        ddp(torch.randn(8, 64), b_first=dist.get_rank() == 1).backward()
    n_params = len(list(net.parameters()))
    return {"arrived": arrived[:n_params], "after": [list(b.param_names) for b in ddp.buckets]}


def ddp_in_a_group_of_one() -> dict[str, float]:
    """Each rank runs dplab.DDP and torch's DDP in a process group of its own (one rank):
    the largest difference of each one's gradient from the rank's own, undistributed gradient.
    A DDP that averaged over the whole job instead of its group would halve it."""
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank calls each
    mine = groups[dist.get_rank()]
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(dist.get_rank()))
    grads = {}
    for name, wrap in (("dplab", DDP), ("torch", nn.parallel.DistributedDataParallel)):
        torch.manual_seed(0)
        ddp = wrap(nn.Linear(64, 64), process_group=mine)
        ddp(x).square().sum().backward()
        grads[name] = ddp.module.weight.grad
    torch.manual_seed(0)
    plain = nn.Linear(64, 64)
    plain(x).square().sum().backward()
    return {k: float((g - plain.weight.grad).abs().max()) for k, g in grads.items()}
