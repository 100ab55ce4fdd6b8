"""check_my_ddp: each reference solution passes its step, each typical wrong answer is rejected
with the message that names it, and an untouched stub is "not attempted yet"."""

from __future__ import annotations

import itertools
import math
import types

import pytest
import torch
import torch.distributed as dist

import dplab
from dplab.exercises.my_ddp import (
    FAILED,
    NOT_ATTEMPTED,
    PASSED,
    check_my_ddp,
    close_at_cap_plan,
    greedy_plan,
)
from dplab.exercises.my_ddp_solutions import (
    MIB,
    BucketedMyDDP,
    NaiveMyDDP,
    OverlappedMyDDP,
    greedy_buckets,
)
from dplab.exercises.my_ddp_timeline import trace_rank

REFERENCES = {"naive": NaiveMyDDP, "overlapped": OverlappedMyDDP, "bucketed": BucketedMyDDP}


@pytest.fixture(scope="module")
def cluster4():
    with dplab.Cluster(4, backend="gloo", timeout_s=60) as c:
        yield c


# -- wrong answers learners write ------------------------------------------------------------------


class Untouched(torch.nn.Module):
    def __init__(self, module, bucket_size_mb=None):
        super().__init__()
        raise NotImplementedError

    def forward(self, *args, **kwargs):
        raise NotImplementedError

    def finish_gradient_synchronization(self):
        raise NotImplementedError


class SumNotAverage(NaiveMyDDP):
    def finish_gradient_synchronization(self):
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)


class DoNothing(NaiveMyDDP):
    def finish_gradient_synchronization(self):
        pass


class ReduceTheWeights(NaiveMyDDP):
    def finish_gradient_synchronization(self):
        with torch.no_grad():
            for p in self.module.parameters():
                dist.all_reduce(p.data)
                p.data /= dist.get_world_size()


class BlockingHook(OverlappedMyDDP):
    def _launch(self, param):
        dist.all_reduce(param.grad)  # synchronous: backward waits here
        param.grad.div_(dist.get_world_size())


class AsyncThenWaitInHook(OverlappedMyDDP):
    def _launch(self, param):
        dist.all_reduce(param.grad, async_op=True).wait()
        param.grad.div_(dist.get_world_size())


class NoWait(OverlappedMyDDP):
    def finish_gradient_synchronization(self):
        self._handles.clear()


class RegisterInForward(OverlappedMyDDP):
    """Registers the hooks again in every forward: from step 1 on, each fires twice."""

    def forward(self, *args, **kwargs):
        for p in self.module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._launch)
        return self.module(*args, **kwargs)


class ReduceACopy(OverlappedMyDDP):
    """A right answer that all-reduces a copy of each gradient and copies the average back."""

    def _launch(self, param):
        copy = param.grad / dist.get_world_size()
        self._handles.append((param, copy, dist.all_reduce(copy, async_op=True)))

    def finish_gradient_synchronization(self):
        for param, copy, handle in self._handles:
            handle.wait()
            param.grad.copy_(copy)
        self._handles.clear()


class ForwardOrderBuckets(BucketedMyDDP):
    def __init__(self, module, bucket_size_mb=None):
        flip = _reversed_parameters(module)
        super().__init__(module, bucket_size_mb)
        flip.undo()


class _reversed_parameters:
    """Make ``module.parameters()`` come out reversed while the class is built, so that the
    reference's ``[::-1]`` cuts the buckets from the first layer on."""

    def __init__(self, module):
        self.module, self.original = module, module.parameters
        params = list(module.parameters())[::-1]
        module.parameters = lambda *a, **k: iter(params)

    def undo(self):
        self.module.parameters = self.original


class LaunchBeforeFull(BucketedMyDDP):
    def _grad_ready(self, param):
        b, offset = self._slot[id(param)]
        self._buffers[b][offset : offset + param.numel()].copy_(param.grad.reshape(-1))
        self._pending[b] -= 1
        if self._pending[b] == min(1, len(self._buckets[b]) - 1):  # off by one
            self._buffers[b].div_(dist.get_world_size())
            self._handles.append(dist.all_reduce(self._buffers[b], async_op=True))

    def finish_gradient_synchronization(self):
        for h in self._handles:
            h.wait()
        for members, buffer in zip(self._buckets, self._buffers, strict=True):
            offset = 0
            for p in members:
                p.grad.copy_(buffer[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        self._reset()


class LaunchAtTheEnd(BucketedMyDDP):
    def _grad_ready(self, param):
        b, offset = self._slot[id(param)]
        self._buffers[b][offset : offset + param.numel()].copy_(param.grad.reshape(-1))

    def finish_gradient_synchronization(self):
        for buffer in self._buffers:
            buffer.div_(dist.get_world_size())
            self._handles.append(dist.all_reduce(buffer, async_op=True))
        super().finish_gradient_synchronization()


class BucketTheFrozen(torch.nn.Module):
    """Buckets over every parameter; the frozen ones' slots stay zero and travel anyway."""

    def __init__(self, module, bucket_size_mb=None):
        super().__init__()
        self.module = module
        cap = bucket_size_mb * MIB
        params = list(module.parameters())[::-1]
        plan = greedy_buckets([p.numel() * p.element_size() for p in params], cap)
        self.buckets = [[params[i] for i in members] for members in plan]
        self.buffers = [torch.zeros(sum(p.numel() for p in b), dtype=torch.float64)
                        for b in self.buckets]  # fmt: skip
        self.slot = {}
        for b, members in enumerate(self.buckets):
            offset = 0
            for p in members:
                self.slot[id(p)] = (b, offset)
                offset += p.numel()
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._ready)
        self.reset()

    def reset(self):
        self.pending = [sum(p.requires_grad for p in b) for b in self.buckets]
        self.handles = []

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _ready(self, param):
        b, offset = self.slot[id(param)]
        self.buffers[b][offset : offset + param.numel()].copy_(param.grad.reshape(-1))
        self.pending[b] -= 1
        if self.pending[b] == 0:
            self.buffers[b].div_(dist.get_world_size())
            self.handles.append(dist.all_reduce(self.buffers[b], async_op=True))

    def finish_gradient_synchronization(self):
        for h in self.handles:
            h.wait()
        for members, buffer in zip(self.buckets, self.buffers, strict=True):
            offset = 0
            for p in members:
                if p.grad is not None:
                    p.grad.copy_(buffer[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        self.reset()


class TorchRuleBuckets(BucketedMyDDP):
    """Closes a bucket once it reaches the cap (so it may exceed it by one tensor)."""

    def __init__(self, module, bucket_size_mb=None):
        import dplab.exercises.my_ddp_solutions as s

        original = s.greedy_buckets
        s.greedy_buckets = close_at_cap_plan
        try:
            super().__init__(module, bucket_size_mb)
        finally:
            s.greedy_buckets = original


class RaisesInForward(NaiveMyDDP):
    def forward(self, *args, **kwargs):
        raise ValueError("oops")


# -- the checks ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", REFERENCES)
def test_each_reference_passes_its_step(kind, cluster2):
    result = check_my_ddp(REFERENCES[kind], kind=kind, cluster=cluster2)
    assert result.status == PASSED, result.message
    assert "equal torch DDP's" in result.message


@pytest.mark.parametrize("kind", REFERENCES)
def test_each_reference_passes_on_four_ranks(kind, cluster4):
    result = check_my_ddp(REFERENCES[kind], kind=kind, cluster=cluster4)
    assert result.status == PASSED, result.message
    assert result.message.startswith("on 4 ranks")


def test_an_all_reduce_of_a_copy_is_right_too(cluster2):
    assert check_my_ddp(ReduceACopy, kind="overlapped", cluster=cluster2).passed


def test_the_later_solutions_also_pass_the_earlier_steps(cluster2):
    assert check_my_ddp(BucketedMyDDP, kind="naive", cluster=cluster2).passed
    assert check_my_ddp(BucketedMyDDP, kind="overlapped", cluster=cluster2).status == FAILED
    assert check_my_ddp(OverlappedMyDDP, kind="naive", cluster=cluster2).passed


@pytest.mark.parametrize(
    "cls, kind, named",
    [
        (SumNotAverage, "naive", "sum instead of average: the gradients are 2×"),
        (ReduceTheWeights, "naive", "all-reduce of parameters instead of gradients"),
        (DoNothing, "naive", "no all-reduce seen"),
        (BlockingHook, "overlapped", "blocking all-reduce in the hook: all_reduce(async_op=False)"),
        (AsyncThenWaitInHook, "overlapped", "blocking all-reduce in the hook: wait()"),
        (NoWait, "overlapped", "no wait before the step"),
        (NaiveMyDDP, "overlapped", "no overlap"),
        (RegisterInForward, "overlapped", "was all-reduced 2 times in one step"),
        (ForwardOrderBuckets, "bucketed", "forward-order buckets"),
        (LaunchBeforeFull, "bucketed", "launching before a bucket is full"),
        (OverlappedMyDDP, "bucketed", "one collective per parameter when buckets were asked for"),
        (LaunchAtTheEnd, "bucketed", "no overlap"),
        (BucketTheFrozen, "bucketed", "a collective for parameters without gradients"),
        (TorchRuleBuckets, "bucketed", "your buckets close once they reach the cap"),
        (BlockingHook, "bucketed", "blocking all-reduce in the hook"),
        (SumNotAverage, "bucketed", "one collective per parameter"),
    ],
    ids=lambda v: getattr(v, "__name__", v if isinstance(v, str) and len(v) < 12 else None),
)
def test_typical_wrong_answers_are_named(cls, kind, named, cluster2):
    result = check_my_ddp(cls, kind=kind, cluster=cluster2)
    assert result.status == FAILED
    assert named in result.message, result.message


def test_sum_instead_of_average_says_four_on_four_ranks(cluster4):
    result = check_my_ddp(SumNotAverage, kind="naive", cluster=cluster4)
    assert "sum instead of average: the gradients are 4×" in result.message


def test_untouched_is_not_attempted_and_the_pool_survives(cluster2):
    for kind in REFERENCES:
        assert check_my_ddp(Untouched, kind=kind, cluster=cluster2).status == NOT_ATTEMPTED
        assert check_my_ddp(None, kind=kind, cluster=cluster2).status == NOT_ATTEMPTED
    result = check_my_ddp(RaisesInForward, kind="naive", cluster=cluster2)
    assert result.status == FAILED and "ValueError: oops" in result.message
    assert check_my_ddp(NaiveMyDDP, kind="naive", cluster=cluster2).passed


def test_bad_arguments():
    with pytest.raises(ValueError, match="kind must be one of"):
        check_my_ddp(NaiveMyDDP, kind="fast")
    with pytest.raises(ValueError, match="needs a gloo Cluster, got backend 'nccl'"):
        check_my_ddp(NaiveMyDDP, kind="naive", cluster=types.SimpleNamespace(backend="nccl"))
    assert "expected a class" in check_my_ddp(42, kind="naive").message
    assert (
        "no method finish_gradient_synchronization"
        in check_my_ddp(torch.nn.Linear, kind="naive").message
    )


def test_the_checker_launches_its_own_ranks_without_a_cluster():
    assert check_my_ddp(NaiveMyDDP, kind="naive", world_size=2).passed


# -- the bucket plans against torch's reducer ------------------------------------------------------


def _torch_plan(nbytes, cap):
    tensors = [torch.empty(n // 4, dtype=torch.float32) for n in nbytes]
    buckets, _ = dist._compute_bucket_assignment_by_size(tensors, [cap])
    return sorted(list(b) for b in buckets)


def test_close_at_cap_plan_is_torchs_rule():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        nbytes = [4 * int(n) for n in torch.randint(1, 300, (12,), generator=g)]
        cap = 4 * int(torch.randint(50, 1500, (1,), generator=g))
        assert sorted(close_at_cap_plan(nbytes, cap)) == _torch_plan(nbytes, cap)


def test_greedy_plan_agrees_with_torch_where_the_rules_coincide():
    """Equal tensors and a cap of k of them: "at most the cap" and "close at the cap" cut the
    same buckets, so here the independent plan must equal torch's reducer's."""
    for size in (8, 400, 4096):
        for k in (1, 2, 3, 5):
            nbytes = [size] * 11
            assert sorted(greedy_plan(nbytes, k * size)) == _torch_plan(nbytes, k * size)
            assert len(greedy_plan(nbytes, k * size)) == math.ceil(11 / k)


def test_greedy_plan_never_exceeds_the_cap_nor_splits_a_tensor():
    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        nbytes = [int(n) for n in torch.randint(1, 500, (10,), generator=g)]
        cap = int(torch.randint(1, 1200, (1,), generator=g))
        plan = greedy_plan(nbytes, cap)
        assert [i for b in plan for i in b] == list(range(10))
        for b in plan:
            assert len(b) == 1 or sum(nbytes[i] for i in b) <= cap
        for b, nxt in itertools.pairwise(plan):  # greedy: the next tensor did not fit
            assert sum(nbytes[i] for i in b) + nbytes[nxt[0]] > cap
        assert plan == greedy_buckets(nbytes, cap)


# -- the learner's steps on the timeline -----------------------------------------------------------


def test_the_learners_steps_draw_next_to_dplab_ddp(cluster2):
    from dplab.exercises.my_ddp import expected_buckets
    from dplab.models import make_model
    from dplab.viz.timeline import timeline_figure

    cap_mb = 0.01
    runs = cluster2.run(trace_rank, BucketedMyDDP, "mlp", bucket_size_mb=cap_mb, steps=2)
    want = expected_buckets(make_model("mlp"), cap_mb * MIB)
    assert len(want) >= 2
    for r in runs:
        assert len(r["yours"]) == len(r["dplab.DDP"]) == 2
        for step in r["yours"]:
            comms = step.of("allreduce")
            assert len(comms) == len(want)
            assert sorted(list(b.param_names) for b in step.buckets) == sorted(want)
            backward = step.of("backward")[0]
            assert any(s.start_ms < backward.end_ms for s in comms)  # launched from the hooks
            assert step.of("wait")[0].end_ms <= step.of("optimizer")[0].start_ms + 1e-9
            for s in comms:
                assert s.start_ms <= s.end_ms <= step.of("wait")[0].end_ms + 1e-6
    fig = timeline_figure([[r["yours"][-1] for r in runs], [r["dplab.DDP"][-1] for r in runs]])
    assert len(fig.layout.annotations) >= 2  # two panels


def test_a_queued_collective_starts_when_a_worker_is_free():
    from dplab.exercises.my_ddp_timeline import _queued_starts

    # two workers; the third collective waits for the first to finish
    assert _queued_starts([0, 1, 2, 9], [10, 5, 12, 13], lanes=2) == [0, 1, 5, 10]
