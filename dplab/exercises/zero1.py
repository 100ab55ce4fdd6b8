"""Build your own ZeRO-1: ``check_my_zero1`` and a reference :class:`ShardedOptimizer`.

CS336's interface, so other courses' tests run against the same class:
``ShardedOptimizer(params, optimizer_cls, **kwargs)``, ``step(closure=None, **kwargs)`` and
``add_param_group(param_group)``. Each rank owns some of the parameters, keeps optimizer state
(here SGD's momentum buffers) for those only, steps them, and then sends each updated parameter
from its owner to every rank.

Who averages the gradients? ZeRO-1 proper reduce-scatters them: each rank receives the averaged
gradient of its own shard. So by default the checker trains a plain model (no DDP) on different
data per rank, and the optimizer must average. CS336's version is used under DDP, which has
averaged already: ``check_my_zero1(cls, wrap_ddp=True)`` checks that contract (an optimizer that
averages passes both: averaging equal gradients changes nothing).

On every rank the checker runs three float64 trainings of a small MLP for ``STEPS`` SGD-momentum
steps, with two parameter groups (the second added by ``add_param_group`` with its own lr):
one process on the global batch (the answer), torch's ``ZeroRedundancyOptimizer`` under DDP (the
oracle, which must agree), and the learner's class. It then names the first mistake it sees:
ranks that disagree (no broadcast), a parameter nobody stepped (a partition that lost it),
gradients never averaged or summed, every rank stepping everything (state bytes N times too
many), or an unbalanced partition.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dplab.exercises.checks import FAILED, PASSED, CheckResult, NotAttempted, _run_on_ranks
from dplab.mechanics.traffic import CommCounter

EXERCISE = "build your own ZeRO-1"
WORLD_SIZES = (2, 4)
STEPS = 3
LRS = (0.05, 0.02)  # the first group's lr, and the lr add_param_group gives the second
MOMENTUM = 0.9
TOLERANCE = 1e-10  # float64 weights: only the order of the sums may differ
GRAD_COLLECTIVES = ("all_reduce", "reduce", "reduce_scatter_tensor", "reduce_scatter")


# ---------------------------------------------------------------------------------------------
# The reference answer


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1 in one class: optimizer state for this rank's parameters only.

    Parameters go to ranks greedily, each to the rank with the fewest parameter elements so far
    (same order on every rank, so every rank computes the same owners). ``step`` averages each
    gradient (an all-reduce, then ÷N; a real ZeRO-1 reduce-scatters so that a rank receives only
    its shard's average: the same numbers, half the traffic), steps the local optimizer, and
    broadcasts each parameter from its owner, so every rank ends with the same weights.
    """

    def __init__(self, params: Iterable[Any], optimizer_cls: type, **kwargs: Any):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("ShardedOptimizer needs torch.distributed initialised (a rank)")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.optimizer_cls, self.optimizer_kwargs = optimizer_cls, kwargs
        self.owner: dict[torch.Tensor, int] = {}
        self.load = [0] * self.world_size  # parameter elements owned by each rank so far
        self.local: torch.optim.Optimizer | None = None  # steps this rank's parameters
        super().__init__(params, kwargs)  # calls add_param_group for each group

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        mine = []
        for p in group["params"]:
            owner = min(range(self.world_size), key=lambda r: (self.load[r], r))
            self.owner[p] = owner
            self.load[owner] += p.numel()
            if owner == self.rank:
                mine.append(p)
        if not mine:
            return
        local_group = {**{k: v for k, v in group.items() if k != "params"}, "params": mine}
        if self.local is None:
            self.local = self.optimizer_cls([local_group], **self.optimizer_kwargs)
        else:
            self.local.add_param_group(local_group)

    @torch.no_grad()
    def step(self, closure: Any = None, **kwargs: Any) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for group in self.param_groups for p in group["params"]]
        for p in params:
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(self.world_size)
        if self.local is not None:
            self.local.step(**kwargs)
        self._share_updates(params)
        return loss

    def _share_updates(self, params: list[torch.Tensor]) -> None:
        """Send each parameter from its owner to every rank: the others never stepped it."""
        for p in params:
            dist.broadcast(p.data, src=self.owner[p])


class NoBroadcastShardedOptimizer(ShardedOptimizer):
    """A wrong answer on purpose, the checker's negative control: each rank steps the parameters
    it owns and never sends them, so the ranks drift apart (a mistake learners make)."""

    def _share_updates(self, params: list[torch.Tensor]) -> None:
        return None


# ---------------------------------------------------------------------------------------------
# On each rank


def _model() -> nn.Module:
    """Five parameter tensors (an odd count, so a partition by ``len // N`` loses one)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 7), nn.Tanh(), nn.Linear(7, 1, bias=False)
    ).double()


def _groups(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    params = list(model.parameters())
    return params[:2], params[2:]


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + rank)
    x = torch.randn(8, 6, generator=g, dtype=torch.float64)
    return x, torch.randn(8, 1, generator=g, dtype=torch.float64)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _unsharded(world_size: int, grad_scale: float = 1.0) -> list[torch.Tensor]:
    """One process, the global batch; ``grad_scale=N`` is what summing instead of averaging
    would have stepped with."""
    model = _model()
    first, rest = _groups(model)
    opt = torch.optim.SGD(first, lr=LRS[0], momentum=MOMENTUM)
    opt.add_param_group({"params": rest, "lr": LRS[1]})
    batches = [_batch(r) for r in range(world_size)]
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        _loss(model, x, y).backward()
        for p in model.parameters():
            p.grad.mul_(grad_scale)
        opt.step()
    return _weights(model)


def _state_bytes(opt: Any, depth: int = 2) -> int:
    """Bytes of optimizer state held by ``opt`` and any optimizer it keeps in an attribute
    (the learner's inner optimizer may have any name), each storage once."""
    seen: set[int] = set()
    found: list[torch.optim.Optimizer] = []

    def visit(obj: Any, d: int) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.optim.Optimizer):
            found.append(obj)
        if d == 0:
            return
        if isinstance(obj, list | tuple):
            values: Iterable[Any] = obj
        elif isinstance(obj, dict):
            values = obj.values()
        else:
            values = getattr(obj, "__dict__", {}).values()
        for v in values:
            if isinstance(v, torch.optim.Optimizer | list | tuple | dict) or hasattr(v, "state"):
                visit(v, d - 1)

    visit(opt, depth)
    storages = {}
    for o in found:
        for state in o.state.values():
            for t in state.values():
                if torch.is_tensor(t):
                    st = t.untyped_storage()
                    storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


def _oracle(world_size: int) -> tuple[list[torch.Tensor], int]:
    """torch's ZeroRedundancyOptimizer under DDP: weights after the steps, this rank's state."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = _model()
    ddp = nn.parallel.DistributedDataParallel(model)
    first, rest = _groups(model)
    opt = ZeroRedundancyOptimizer(
        first, optimizer_class=torch.optim.SGD, lr=LRS[0], momentum=MOMENTUM
    )
    opt.add_param_group({"params": rest, "lr": LRS[1]})
    x, y = _batch(dist.get_rank())
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        _loss(ddp, x, y).backward()
        opt.step()
    return _weights(model), _state_bytes(opt)


def _zero1_rank(cls: type, wrap_ddp: bool) -> dict[str, Any] | NotAttempted:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    initial = _weights(model)
    runner: nn.Module = nn.parallel.DistributedDataParallel(model) if wrap_ddp else model
    first, rest = _groups(model)
    x, y = _batch(rank)
    try:
        opt = cls(first, torch.optim.SGD, lr=LRS[0], momentum=MOMENTUM)
        opt.add_param_group({"params": rest, "lr": LRS[1]})
        with CommCounter() as counter:
            for _ in range(STEPS):
                model.zero_grad(set_to_none=True)
                _loss(runner, x, y).backward()
                with counter.phase("step"):
                    opt.step()
    except NotImplementedError:
        return NotAttempted()
    zero_weights, zero_bytes = _oracle(world)
    params = list(model.parameters())
    return {
        "rank": rank,
        "world_size": world,
        "names": [n for n, _ in model.named_parameters()],
        "state_nbytes": [p.numel() * p.element_size() for p in params],  # momentum per param
        "initial": initial,
        "weights": _weights(model),
        "unsharded": _unsharded(world),
        "summed": _unsharded(world, grad_scale=float(world)),
        "zero_weights": zero_weights,
        "zero_state_bytes": zero_bytes,
        "state_bytes": _state_bytes(opt),
        "grad_collectives": sum(counter.calls(op, "step") for op in GRAD_COLLECTIVES),
    }


# ---------------------------------------------------------------------------------------------
# Judging


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[float]:
    return [float((x - y).abs().max()) for x, y in zip(a, b, strict=True)]


def _judge(results: list[dict[str, Any]], wrap_ddp: bool) -> str | None:
    """The first mistake the ranks' results show, as a sentence; None if there is none."""
    r0 = results[0]
    n, names = r0["world_size"], r0["names"]
    if max(_max_diff(r0["zero_weights"], r0["unsharded"])) > TOLERANCE:
        raise RuntimeError("the oracle (ZeroRedundancyOptimizer) disagrees with one process")
    for r in results[1:]:
        diff = _max_diff(r["weights"], r0["weights"])
        if max(diff) > TOLERANCE:
            name = names[diff.index(max(diff))]
            return (
                f"no broadcast after the step (N = {n}): after {STEPS} steps rank {r['rank']} "
                f"and rank 0 disagree on {name!r} by {max(diff):.2e}. Each rank updated only the "
                "parameters it owns; send each one from its owner to every rank "
                "(dist.broadcast(p.data, src=owner)) after the local step."
            )
    triples = zip(r0["weights"], r0["initial"], r0["unsharded"], strict=True)
    unchanged = [
        names[i]
        for i, (w, w0, ref) in enumerate(triples)
        if torch.equal(w, w0) and not torch.equal(ref, w0)
    ]
    if unchanged:
        return (
            f"a parameter nobody steps (N = {n}): {unchanged} never changed. Your partition "
            "lost it (e.g. len(params) // N per rank drops the remainder): every parameter must "
            "be owned by exactly one rank."
        )
    diff = _max_diff(r0["weights"], r0["unsharded"])
    if max(diff) > TOLERANCE:
        name = names[diff.index(max(diff))]
        if max(_max_diff(r0["weights"], r0["summed"])) <= TOLERANCE:
            return (
                f"gradients summed, not averaged (N = {n}): your weights are those of a "
                f"gradient {n} times too big. Divide by dist.get_world_size() after the "
                "all-reduce."
            )
        if r0["grad_collectives"] == 0 and not wrap_ddp:
            return (
                f"state sharded but gradients not averaged (N = {n}): no all-reduce or "
                "reduce-scatter in step(), so each owner stepped with its own rank's gradient "
                f"({name!r} off by {max(diff):.2e}). Average the gradients across ranks before "
                "the local step (or, if your class expects DDP to have averaged them, as "
                "CS336's does, check it with check_my_zero1(cls, wrap_ddp=True))."
            )
        return (
            f"weights differ from one process on the global batch (N = {n}): {name!r} off by "
            f"{max(diff):.2e} after {STEPS} steps (tolerance {TOLERANCE:.0e})."
        )
    full = sum(r0["state_nbytes"])
    held = [r["state_bytes"] for r in results]
    if all(b >= full for b in held):
        return (
            f"every rank steps everything (N = {n}): each rank holds {held[0]} bytes of "
            f"optimizer state, all {full} of the unsharded optimizer's. Give each rank's "
            "optimizer only the parameters that rank owns."
        )
    if sum(held) != full:
        return (
            f"optimizer state is not partitioned (N = {n}): the ranks hold {held} bytes, "
            f"{sum(held)} in all, where the parameters' momentum is {full} bytes: each "
            "parameter's state must live on exactly one rank."
        )
    bound = full / n + max(r0["state_nbytes"])  # what a greedy split can always stay under
    if max(held) > bound:
        return (
            f"unbalanced partition (N = {n}): the ranks hold {held} bytes of optimizer state; "
            f"a balanced split keeps every rank under {bound:.0f} (1/N of {full} plus the "
            "largest parameter). Assign each parameter to the least-loaded rank."
        )
    return None


def check_my_zero1(cls: type | None, cluster: Any = None, *, wrap_ddp: bool = False) -> CheckResult:
    """Run the learner's ``ShardedOptimizer`` class on real ranks (N = 2 and 4) and judge it.

    ``cluster`` is a warm :class:`dplab.Cluster` or a list of them (one per world size); a world
    size with none gets ranks of its own. ``wrap_ddp=True`` wraps the model in DDP first (the
    gradients arrive averaged, CS336's contract).
    """
    rows = []
    for world_size in WORLD_SIZES:
        results = _run_on_ranks(EXERCISE, _zero1_rank, cls, cluster, world_size, wrap_ddp)
        if isinstance(results, CheckResult):
            return results
        mistake = _judge(results, wrap_ddp)
        if mistake is not None:
            return CheckResult(EXERCISE, FAILED, mistake, {"results": results})
        held = [r["state_bytes"] for r in results]
        zero = [r["zero_state_bytes"] for r in results]
        rows.append(f"N = {world_size}: yours {held} B, ZeroRedundancyOptimizer's {zero} B")
    return CheckResult(
        EXERCISE,
        PASSED,
        f"after {STEPS} steps every rank's weights equal one process on the global batch and "
        f"torch's ZeroRedundancyOptimizer (within {TOLERANCE:.0e}), and each parameter's "
        f"optimizer state lives on one rank: {'; '.join(rows)}.",
    )
