"""Rank function: one model, one recipe, four ways to hold it (DDP, ZeRO-1, FSDP2 twice).

Launched with :func:`dplab.launch` or :meth:`dplab.Cluster.run`, :func:`sharded_step` builds the
same small GPT on every rank, wraps it as ``method`` says, trains ``steps`` steps on the rank's
shard of the batch and measures, on real tensors:

* the model state at rest after the last step, part by part. Under FSDP2 every parameter, its
  gradient and its optimizer state are DTensors; a rank holds only their *local* shard, and that
  local storage is what is counted (each storage once, as :mod:`dplab.memory.measure` does);
* the peak by phase: the bytes of everything the model and optimizer hold, walked at every tensor
  autograd saves in forward, at every one it reads back in backward, and around the optimizer
  step. While FSDP2 has a unit's weights gathered, the module's parameters are the gathered full
  tensors, so the walk sees that unit's transient (activations are not counted: they are the
  same for every method and are 09's subject);
* every collective of the last step, by phase (:class:`~dplab.sharding.wire.ShardedCommCounter`);
* the first step's full gradient and the full weights after it (gathered from the shards after
  the fact, outside the counter), to compare with DDP and with one process on the global batch.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dplab.memory.measure import storage_bytes_by_part
from dplab.memory.ranks import sub_group
from dplab.memory.recipes import PARTS
from dplab.models import GPTConfig, TinyGPT
from dplab.sharding.compat import fully_shard_api
from dplab.sharding.formula import check_method
from dplab.sharding.wire import ShardedCommCounter

# Small enough for four ranks on two cores, every dim divisible by 4 so that FSDP2's dim-0
# shards are even (an uneven shard is padded, and the padding would be counted as state).
SHARDED_GPT = GPTConfig(
    vocab=256, seq_len=16, d_model=64, n_layers=2, n_heads=4, tie_embeddings=False, p_drop=0.0
)
PHASES = ("forward", "backward", "optimizer")
OPTIMIZERS = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}
DTYPES = {"float32": torch.float32, "float64": torch.float64}
LR = 1e-2
MICRO_BATCH = 2


@dataclass
class ShardedStep:
    """What one rank measured (see the module docstring). Bytes are this rank's."""

    method: str
    rank: int
    world_size: int
    per_block: bool
    n_params: int
    parts: dict[str, int]  # model state at rest after the last step, by part (PARTS)
    peak: dict[str, int]  # forward, backward, optimizer: the most held at any sampled moment
    records: list[dict[str, Any]]  # the last step's collectives (CommCounter.to_dicts())
    step_ms: float  # the last step, forward to optimizer, on this rank's clock
    grads: torch.Tensor  # the first step's full gradient, flat, in parameter order
    weights: torch.Tensor  # the full weights after the first step, flat
    backend_events: dict[str, int]  # with profile=True: "gloo:all_reduce" → count, last step

    @property
    def state_bytes(self) -> int:
        """Model state at rest: weights + grads + master weights + optimizer state."""
        return sum(self.parts[p] for p in PARTS)

    @property
    def bytes_per_param(self) -> float:
        return self.state_bytes / self.n_params


def sharded_model(dtype: torch.dtype = torch.float32, config: GPTConfig = SHARDED_GPT) -> TinyGPT:
    """The lesson's GPT, the same weights on every rank and in every process (seed 0)."""
    torch.manual_seed(0)
    return TinyGPT(config).to(dtype)


def rank_batch(rank: int, config: GPTConfig = SHARDED_GPT) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch: tokens and next-token targets, reproducible."""
    g = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(0, config.vocab, (MICRO_BATCH, config.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank stores); any other tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor's shards gathered from every rank (a collective)."""
    full_tensor = getattr(t, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else t


def _optimizer_state(opt: Any) -> list[torch.Tensor]:
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps its shard's optimizer
    return [_local(v) for s in inner.state.values() for v in s.values() if torch.is_tensor(v)]


class _Walk:
    """The bytes the model and optimizer hold right now, sampled at moments of a phase."""

    def __init__(self, model: nn.Module, params: list[torch.Tensor], opt: Any):
        self.model, self.params, self.opt = model, params, opt
        self.phase: str | None = None
        self.peak = dict.fromkeys(PHASES, 0)

    def held(self) -> int:
        current = list(self.model.parameters())  # FSDP2 swaps in gathered tensors while in use
        tensors = [_local(p) for p in self.params] + [_local(p) for p in current]
        tensors += [_local(p.grad) for p in self.params + current if p.grad is not None]
        tensors += _optimizer_state(self.opt)
        return sum(storage_bytes_by_part({"all": tensors}).values())

    def sample(self) -> None:
        if self.phase is not None:
            self.peak[self.phase] = max(self.peak[self.phase], self.held())

    @contextlib.contextmanager
    def during(self, phase: str) -> Iterator[None]:
        self.phase = phase
        self.sample()
        try:
            yield
        finally:
            self.sample()
            self.phase = None

    def hooks(self) -> Any:
        def pack(t: torch.Tensor) -> torch.Tensor:
            self.sample()
            return t

        def unpack(t: torch.Tensor) -> torch.Tensor:
            self.sample()
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _wrap(
    method: str, model: nn.Module, opt_cls: type, group: Any, per_block: bool
) -> tuple[nn.Module, Any]:
    """The model as ``method`` runs it, and its optimizer."""
    if method in ("ddp", "zero1"):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        # DDP also broadcasts the GPT's buffer (a constant causal mask) at each forward, from
        # C++: no counter sees it, and it is not model state, so it is left out of the bytes
        ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
        # torch's default all-reduce, but called through torch.distributed (the reducer's own
        # call is C++ and no counter would see it); same arithmetic: divide by N, then sum
        ddp.register_comm_hook(group, allreduce_hook)
        if method == "ddp":
            return ddp, opt_cls(model.parameters(), lr=LR)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        zero = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=opt_cls, process_group=group, lr=LR
        )
        return ddp, zero
    fully_shard, _ = fully_shard_api()
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.from_group(group or dist.group.WORLD, "cpu")
    reshard = method == "zero3"  # zero2: keep the gathered weights from forward to backward
    if per_block:
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model, opt_cls(model.parameters(), lr=LR)


def _backend_profiler(on: bool) -> Any:
    if not on:
        return contextlib.nullcontext()
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU])


def _backend_events(profiler: Any) -> dict[str, int]:
    """How many of each backend event (``gloo:...``, ``nccl:...``) the profiled step ran."""
    names = [e.name for e in profiler.events() if e.name.split(":")[0] in ("gloo", "nccl")]
    return {name: names.count(name) for name in sorted(set(names))}


@contextlib.contextmanager
def _counting(counter: ShardedCommCounter, phase: str, on: bool) -> Iterator[None]:
    if not on:
        yield
        return
    with counter, counter.phase(phase):
        yield


def sharded_step(
    method: str,
    *,
    optimizer: str = "adamw",
    dtype: str = "float32",
    per_block: bool = True,
    steps: int = 2,
    group_size: int | None = None,
    profile: bool = False,
) -> ShardedStep | None:
    """Run on every rank: build, wrap as ``method``, train ``steps`` steps, measure.

    ``method`` is ``"ddp"``, ``"zero1"``, ``"zero2"`` or ``"zero3"`` (see
    :mod:`dplab.sharding.formula`); ``per_block=False`` makes the whole GPT one FSDP unit.
    ``group_size=n`` runs on the first ``n`` ranks only (the others return ``None``), so one warm
    :class:`dplab.Cluster` measures several world sizes. ``profile=True`` runs the last step
    under ``torch.profiler`` and counts the backend's own events (``gloo:all_reduce``, ...): what
    the backend ran, as opposed to what FSDP asked for.
    """
    method = _check_args(method, optimizer, dtype, steps)
    rank = dist.get_rank()
    group, world = sub_group(group_size)  # every rank takes part in making the group
    if rank >= world:
        return None

    model = sharded_model(DTYPES[dtype])
    n_params = sum(p.numel() for p in model.parameters())
    wrapped, opt = _wrap(method, model, OPTIMIZERS[optimizer], group, per_block)
    params = list(model.parameters())  # at rest: FSDP2's sharded DTensors
    walk = _Walk(model, params, opt)
    counter = ShardedCommCounter()
    x, y = rank_batch(rank)
    grads = weights = torch.empty(0)
    step_ms = 0.0
    backend_events: dict[str, int] = {}
    for step in range(steps):
        last = step == steps - 1
        opt.zero_grad(set_to_none=True)
        dist.barrier(group=group)
        profiler = _backend_profiler(profile and last)
        t0 = time.perf_counter()
        with profiler, walk.hooks():
            with walk.during("forward"), _counting(counter, "forward", last):
                loss = wrapped(x, y)
            with walk.during("backward"), _counting(counter, "backward", last):
                loss.backward()
        t_backward = time.perf_counter()
        if step == 0:
            grads = torch.cat([_full(p.grad).detach().reshape(-1) for p in params]).clone()
        t_opt = time.perf_counter()
        with walk.during("optimizer"), _counting(counter, "optimizer", last):
            opt.step()
        t1 = time.perf_counter()
        if profile and last:
            backend_events = _backend_events(profiler)
        step_ms = 1e3 * ((t_backward - t0) + (t1 - t_opt))
        if step == 0:
            weights = torch.cat([_full(p).detach().reshape(-1) for p in params]).clone()

    held = {
        "weights": [_local(p) for p in params],
        "grads": [_local(p.grad) for p in params if p.grad is not None],
        "master_weights": [],
        "optimizer_state": _optimizer_state(opt),
    }
    return ShardedStep(
        method=method,
        rank=rank,
        world_size=world,
        per_block=per_block,
        n_params=n_params,
        parts=storage_bytes_by_part(held),
        peak=dict(walk.peak),
        records=counter.to_dicts(),
        step_ms=step_ms,
        grads=grads,
        weights=weights,
        backend_events=backend_events,
    )


def _check_args(method: str, optimizer: str, dtype: str, steps: int) -> str:
    """The checked method name; a bad optimizer, dtype or step count is refused by name."""
    method = check_method(method)
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {optimizer!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    return method


def global_batch_step(
    world_size: int, *, optimizer: str = "sgd", dtype: str = "float64"
) -> tuple[torch.Tensor, torch.Tensor]:
    """One process, no ranks: the first step on the whole global batch (every rank's micro-batch
    concatenated). Returns ``(gradient, weights after the step)``, flat: data parallelism's answer
    must be this one, whatever holds the state."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {optimizer!r}")
    model = sharded_model(DTYPES[dtype])
    batches = [rank_batch(r) for r in range(world_size)]
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    opt = OPTIMIZERS[optimizer](model.parameters(), lr=LR)
    model(x, y).backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()
    opt.step()
    return grads, torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
