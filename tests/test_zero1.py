"""``check_my_zero1`` passes correct ZeRO-1 optimizers and names each typical mistake.

Two correct answers (the reference, greedy by size with an all-reduce; and a round-robin one
that reduces each gradient to its owner only, as ZeRO-1's reduce-scatter does) and five wrong
ones, each written the way a learner would, each expected to fail with its own message. All run
on two warm pools (N = 2 and 4) shared by the module.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dplab
from dplab.exercises import NoBroadcastShardedOptimizer, ShardedOptimizer, check_my_zero1


class RoundRobinZero1(torch.optim.Optimizer):
    """Correct, differently: parameter i belongs to rank i % N; each gradient is *reduced* to
    its owner (summed there, divided there), the owner steps, then broadcasts."""

    def __init__(self, params, optimizer_cls, **kwargs):
        self.rank, self.n = dist.get_rank(), dist.get_world_size()
        self.cls, self.kwargs, self.inner, self.count, self.owner = optimizer_cls, kwargs, [], 0, {}
        super().__init__(params, kwargs)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        mine = []
        for p in group["params"]:
            self.owner[p] = self.count % self.n
            self.count += 1
            if self.owner[p] == self.rank:
                mine.append(p)
        if mine:
            options = {k: v for k, v in group.items() if k != "params"}
            self.inner.append(self.cls([{"params": mine, **options}], **self.kwargs))

    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        params = [p for g in self.param_groups for p in g["params"]]
        for p in params:
            dist.reduce(p.grad, dst=self.owner[p])
            if self.owner[p] == self.rank:
                p.grad.div_(self.n)
        for opt in self.inner:
            opt.step(**kwargs)
        for p in params:
            dist.broadcast(p.data, src=self.owner[p])


class EveryRankStepsEverything(torch.optim.Optimizer):
    """Wrong: averages and steps every parameter on every rank (right weights, no saving)."""

    def __init__(self, params, optimizer_cls, **kwargs):
        self.inner = None
        self.cls, self.kwargs = optimizer_cls, kwargs
        super().__init__(params, kwargs)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = dict(self.param_groups[-1])
        if self.inner is None:
            self.inner = self.cls([group], **self.kwargs)
        else:
            self.inner.add_param_group(group)

    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        for g in self.param_groups:
            for p in g["params"]:
                dist.all_reduce(p.grad)
                p.grad.div_(dist.get_world_size())
        self.inner.step()


class LosesAParameter(torch.optim.Optimizer):
    """Wrong: len(params) // N parameters per rank, the remainder owned by nobody."""

    def __init__(self, params, optimizer_cls, **kwargs):
        self.rank, self.n = dist.get_rank(), dist.get_world_size()
        self.cls, self.kwargs, self.inner, self.owner = optimizer_cls, kwargs, [], {}
        super().__init__(params, kwargs)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        per_rank = max(1, len(group["params"]) // self.n)
        mine = []
        for i, p in enumerate(group["params"][: per_rank * self.n]):
            self.owner[p] = i // per_rank
            if self.owner[p] == self.rank:
                mine.append(p)
        if mine:
            options = {k: v for k, v in group.items() if k != "params"}
            self.inner.append(self.cls([{"params": mine, **options}], **self.kwargs))

    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        for g in self.param_groups:
            for p in g["params"]:
                dist.all_reduce(p.grad)
                p.grad.div_(self.n)
        for opt in self.inner:
            opt.step()
        for p, owner in self.owner.items():
            dist.broadcast(p.data, src=owner)


class NotAveraged(ShardedOptimizer):
    """Wrong (without DDP around it): shards state, never touches the gradients."""

    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        if self.local is not None:
            self.local.step()
        for g in self.param_groups:
            for p in g["params"]:
                dist.broadcast(p.data, src=self.owner[p])


class Summed(ShardedOptimizer):
    """Wrong: all-reduces the gradients and forgets to divide."""

    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        params = [p for g in self.param_groups for p in g["params"]]
        for p in params:
            dist.all_reduce(p.grad)
        if self.local is not None:
            self.local.step()
        for p in params:
            dist.broadcast(p.data, src=self.owner[p])


@pytest.fixture(scope="module")
def pools():
    with dplab.Cluster(2, backend="gloo") as two, dplab.Cluster(4, backend="gloo") as four:
        yield [two, four]


@pytest.mark.parametrize("cls", [ShardedOptimizer, RoundRobinZero1], ids=lambda c: c.__name__)
def test_correct_answers_pass(cls, pools):
    result = check_my_zero1(cls, pools)
    assert result.passed, result.message
    assert "ZeroRedundancyOptimizer" in result.message


WRONG = {
    EveryRankStepsEverything: "every rank steps everything",
    NoBroadcastShardedOptimizer: "no broadcast after the step",  # 09b's negative control
    LosesAParameter: "a parameter nobody steps",
    NotAveraged: "gradients not averaged",
    Summed: "gradients summed, not averaged",
}


@pytest.mark.parametrize("cls", list(WRONG), ids=lambda c: c.__name__)
def test_each_mistake_is_named(cls, pools):
    result = check_my_zero1(cls, pools)
    assert not result.passed
    assert WRONG[cls] in result.message, result.message


def test_cs336_contract_under_ddp(pools):
    """An optimizer that leaves averaging to DDP (CS336's) passes when the model is in DDP."""
    assert check_my_zero1(NotAveraged, pools, wrap_ddp=True).passed


def test_not_attempted_and_not_a_class(pools):
    class Untouched(torch.optim.Optimizer):
        def __init__(self, params, optimizer_cls, **kwargs):
            raise NotImplementedError

    assert check_my_zero1(None).status == "not attempted yet"
    assert check_my_zero1(Untouched, pools).status == "not attempted yet"
    assert not check_my_zero1(42).passed
