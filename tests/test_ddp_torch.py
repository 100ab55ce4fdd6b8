"""dplab.DDP against torch 2.x's own reducer, on 2 gloo ranks: the oracle nobody here wrote.

Buckets: torch's are read from ``ddp.reducer._get_zeros_like_grad_buckets()`` (one GradBucket per
bucket, whose ``parameters()`` name its members), before the first step and after two steps, on
a torch DDP built on an identical copy of the same model. Compared: the parameter names of every
bucket, in bucket order and in buffer order. Gradients: every ``.grad`` after each of three steps,
compared bit for bit (tolerance 0: at world size 2 an element's sum is a + b in either order and
the factor 1/2 is exact). Comm hooks: torch's own hooks, registered unchanged on both sides.
"""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

import dplab


class Tied(nn.Module):
    """An embedding whose weight the head shares (a tied parameter appears once)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.mid = nn.Linear(32, 32)
        self.head = nn.Linear(32, 64, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(torch.tanh(self.mid(self.emb(x))))


class TwoDtypes(nn.Module):
    """float32 layers around a float64 one: one bucket list per dtype."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16).double()
        self.c = nn.Linear(16, 16)
        self.d = nn.Linear(16, 16).double()

    def forward(self, x):
        return self.d(self.c(self.b(self.a(x).double()).float()).double())


class Sparse(nn.Module):
    """Sparse gradients between dense ones: torch gives each its own bucket."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16, sparse=True)
        self.mid = nn.Linear(16, 16)
        self.bag = nn.EmbeddingBag(64, 16, sparse=True)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.mid(self.emb(x).mean(1))) + self.bag(x))


def linears(n=6, width=256):
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(n)])


def _model(kind: str) -> tuple[nn.Module, callable]:
    torch.manual_seed(0)
    if kind == "tied":
        return Tied(), lambda step: torch.randint(0, 64, (4, 5), generator=_gen(step))
    if kind == "dtypes":
        return TwoDtypes(), lambda step: torch.randn(4, 16, generator=_gen(step))
    if kind == "sparse":
        return Sparse(), lambda step: torch.randint(0, 64, (4, 5), generator=_gen(step))
    if kind == "frozen":
        m = linears()
        for i in (0, 3):
            m[i].weight.requires_grad_(False)
        m[4].bias.requires_grad_(False)
        return m, lambda step: torch.randn(4, 256, generator=_gen(step))
    if kind == "ignored":
        m = linears()
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            m, ["2.weight", "2.bias"]
        )
        return m, lambda step: torch.randn(4, 256, generator=_gen(step))
    return linears(), lambda step: torch.randn(4, 256, generator=_gen(step))


def _gen(step: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 * step + dist.get_rank())


def _names(model: nn.Module, tensors) -> list[str]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id[id(t)] for t in tensors]


def _torch_buckets(ddp) -> list[list[str]]:
    return [_names(ddp.module, b.parameters()) for b in ddp.reducer._get_zeros_like_grad_buckets()]


def _ours(ddp) -> list[list[str]]:
    return [list(b.param_names) for b in ddp.buckets]


def _side_by_side(
    kind: str, kwargs: dict, env: dict, steps: int = 3, set_to_none: bool = True
) -> dict:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        model, batch = _model(kind)
        theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(model), **kwargs)
        ours = dplab.DDP(model, **kwargs)
        # torch's reducer has no GradBucket for a sparse gradient before one exists: its buckets
        # are read after the steps, and before them the sizes torch logs.
        before = kind != "sparse"
        out = {
            "torch": [_torch_buckets(theirs)] if before else [],
            "dplab": [_ours(ours)] if before else [],
            "grad_diffs": [],
            "sizes": [n._get_ddp_logging_data()["bucket_sizes"] for n in (theirs, ours)],
        }
        nets = (ours, theirs)
        opts = [torch.optim.SGD(n.parameters(), lr=0.1) for n in nets]
        for step in range(steps):
            x = batch(step)
            for net in nets:
                net(x).float().pow(2).mean().backward()
            out["grad_diffs"].append(_grad_diff(ours.module, theirs.module))
            for opt in opts:
                opt.step()
                opt.zero_grad(set_to_none=set_to_none)
            if step == 1:
                out["torch"].append(_torch_buckets(theirs))
                out["dplab"].append(_ours(ours))
        out["logged_gabv"] = theirs._get_ddp_logging_data()["gradient_as_bucket_view"]
        return out
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _grad_diff(a: nn.Module, b: nn.Module) -> float:
    worst = 0.0
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        if (p.grad is None) != (q.grad is None):
            return float("inf")  # one side has a gradient, the other none: a mismatch
        if p.grad is not None:
            if p.grad.is_sparse != q.grad.is_sparse:
                return float("inf")
            a_grad, b_grad = (g.to_dense() if g.is_sparse else g for g in (p.grad, q.grad))
            worst = max(worst, (a_grad.double() - b_grad.double()).abs().max().item())
    return worst


def _bucket_sizes(buckets: list[list[str]]) -> list[int]:
    return [len(b) for b in buckets]


# The issue's table: 6 x Linear(256), params per bucket before the first step -> after two.
TABLE = [
    ({}, [12], [8, 4]),
    ({"bucket_cap_mb": 0.5}, [12], [4, 4, 4]),
    ({"find_unused_parameters": True}, [5, 7], [5, 7]),
    ({"find_unused_parameters": True, "bucket_cap_mb": 0.6}, [1, 6, 5], [1, 6, 5]),
]


@pytest.mark.parametrize(("kwargs", "before", "after"), TABLE)
def test_the_issues_table_six_linears(cluster2, kwargs, before, after):
    for r in cluster2.run(_side_by_side, "linears", kwargs, {}):
        assert _bucket_sizes(r["torch"][0]) == before  # the oracle still says what the table says
        assert _bucket_sizes(r["torch"][1]) == after
        assert r["dplab"] == r["torch"]  # same members, same order, before and after
        assert r["grad_diffs"] == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("kind", "kwargs", "env"),
    [
        ("tied", {"bucket_cap_mb": 0.01}, {}),
        ("frozen", {"bucket_cap_mb": 0.3}, {}),
        ("ignored", {"bucket_cap_mb": 0.3}, {}),
        ("frozen", {"find_unused_parameters": True, "bucket_cap_mb": 0.3}, {}),
        ("dtypes", {"bucket_cap_mb": 0.002}, {}),
        ("dtypes", {}, {}),
        ("linears", {"bucket_cap_mb": 0.6}, {"DDP_SET_LAST_BUCKET_CAP": "1"}),
        ("linears", {}, {"DDP_SET_LAST_BUCKET_CAP": "1"}),
        ("linears", {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.5}, {}),
        ("sparse", {}, {}),
        ("sparse", {"bucket_cap_mb": 0.001}, {}),
        ("sparse", {"find_unused_parameters": True, "bucket_cap_mb": 0.001}, {}),
        ("sparse", {"gradient_as_bucket_view": True}, {}),
    ],
    ids=[
        "tied",
        "frozen",
        "ignored",
        "frozen-find-unused",
        "two-dtypes-cap",
        "two-dtypes",
        "set-last-bucket-cap-0.6",
        "set-last-bucket-cap-default",
        "bucket-view",
        "sparse",
        "sparse-cap",
        "sparse-find-unused",
        "sparse-bucket-view",
    ],
)
def test_buckets_and_gradients_equal_torchs(cluster2, kind, kwargs, env):
    for r in cluster2.run(_side_by_side, kind, kwargs, env):
        assert r["dplab"] == r["torch"]
        assert r["sizes"][1] == r["sizes"][0]  # the bucket bytes torch logs at construction
        assert r["grad_diffs"] == [0.0, 0.0, 0.0]


def test_gradients_kept_in_the_bucket_views_between_steps(cluster2):
    """zero_grad(set_to_none=False) with views: .grad already is its slot (torch divides it in
    place, not a copy times 1/N)."""
    kwargs = {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.5}
    for r in cluster2.run(_side_by_side, "linears", kwargs, {}, 3, False):
        assert r["dplab"] == r["torch"]
        assert r["grad_diffs"] == [0.0, 0.0, 0.0]


def test_set_last_bucket_cap_moves_the_small_bucket_to_the_end(cluster2):
    plain, moved = (
        cluster2.run(_side_by_side, "linears", {}, env)[0]
        for env in ({}, {"DDP_SET_LAST_BUCKET_CAP": "1"})
    )
    # The 1 MiB-capped bucket (8 of 12 parameters) first, or last under the variable.
    assert _bucket_sizes(plain["torch"][1]) == [8, 4]
    assert _bucket_sizes(moved["torch"][1]) == [5, 7]
    assert plain["dplab"] == plain["torch"] and moved["dplab"] == moved["torch"]


# -- gradient_as_bucket_view ----------------------------------------------------------------


def _grad_storage(gabv: bool) -> dict:
    torch.manual_seed(0)
    model = linears(3, 32)
    ddp = dplab.DDP(model, gradient_as_bucket_view=gabv, bucket_cap_mb=0.001)
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(model), gradient_as_bucket_view=gabv)
    out = {}
    for name, net, buffers in (
        ("dplab", ddp, lambda: ddp.bucket_buffers),
        (
            "torch",
            theirs,
            lambda: [b.buffer() for b in theirs.reducer._get_zeros_like_grad_buckets()],
        ),
    ):
        for _ in range(2):
            net(torch.randn(2, 32)).sum().backward()
        ptrs = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in buffers()]
        out[name] = [
            any(lo <= p.grad.data_ptr() < hi for lo, hi in ptrs) for p in net.module.parameters()
        ]
    return out


def test_gradient_as_bucket_view_false_by_default_keeps_grads_apart_from_the_buckets(cluster2):
    r = cluster2.run(_grad_storage, False)[0]
    assert not any(r["dplab"])
    views = cluster2.run(_grad_storage, True)[0]
    assert all(views["dplab"])


# -- buffers --------------------------------------------------------------------------------


class WithBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.lin(x))


def _buffer_broadcasts() -> dict:
    """Before each forward, every rank sets its running mean to rank + 1; the same batch on
    every rank then leaves equal running means iff rank 0's were broadcast before the forward."""
    out = {}
    for name, wrap in (("dplab", dplab.DDP), ("torch", nn.parallel.DistributedDataParallel)):
        torch.manual_seed(0)
        net = wrap(WithBN())
        pattern = []
        for kind in ("train", "train", "no_grad", "train", "no_sync", "train", "train"):
            with torch.no_grad():
                net.module.bn.running_mean.fill_(float(dist.get_rank() + 1))
            x = torch.randn(6, 4, generator=torch.Generator().manual_seed(len(pattern)))
            if kind == "no_grad":
                with torch.no_grad():
                    net(x)
            elif kind == "no_sync":
                with net.no_sync():
                    net(x).sum().backward()
            else:
                net(x).sum().backward()
            pattern.append(_equal_on_all_ranks(net.module.bn.running_mean))
        out[name] = pattern
    return out


def _equal_on_all_ranks(t: torch.Tensor) -> bool:
    gathered = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t)
    return all(torch.equal(gathered[0], g) for g in gathered[1:])


def test_buffers_broadcast_exactly_when_torchs_are(cluster2):
    for r in cluster2.run(_buffer_broadcasts):
        # torch: before a forward that follows a synchronising one (the first counts as such)
        assert r["torch"] == [True, True, True, False, True, False, True]
        assert r["dplab"] == r["torch"]


# -- comm hooks -----------------------------------------------------------------------------


def _with_hook(hook_name: str, steps: int = 4) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 16), nn.Linear(16, 8))
    # PowerSGD's Future callbacks block a gloo worker thread on a second all-reduce; with two
    # buckets both of gloo's threads block and torch's own DDP deadlocks too. One bucket for it.
    cap = {} if hook_name == "powersgd" else {"bucket_cap_mb": 0.002}
    nets = [
        dplab.DDP(model, **cap),
        nn.parallel.DistributedDataParallel(copy.deepcopy(model), **cap),
    ]
    states = []
    for net in nets:
        state, hook = None, getattr(default_hooks, hook_name, None)
        if hook_name == "powersgd":
            state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2
            )
            hook = powerSGD_hook.powerSGD_hook
        states.append(state)
        if hook_name == "bf16_compress_hook" and not isinstance(net, dplab.DDP):
            # torch's Python front door refuses bf16 unless NCCL >= 2.10; its reducer takes the
            # very same hook on gloo, so register it there to get the oracle.
            dist._register_comm_hook(net.reducer, state, hook)
        else:
            net.register_comm_hook(state, hook)
    opts = [torch.optim.SGD(n.parameters(), lr=0.05) for n in nets]
    diffs = []
    for step in range(steps):
        x = torch.randn(8, 32, generator=_gen(step))
        for net in nets:
            net(x).pow(2).mean().backward()
        diffs.append(_grad_diff(nets[0].module, nets[1].module))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    # PowerSGD really compressed (from its iteration 2 on), on the bucket index it was given.
    compressed = hook_name == "powersgd" and sorted(states[0].p_memory_dict) == [0]
    return {"diffs": diffs, "buckets": len(nets[0].buckets), "compressed": compressed}


@pytest.mark.parametrize(
    "hook", ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "powersgd"]
)
def test_torchs_own_comm_hooks_give_torchs_gradients(cluster2, hook):
    for r in cluster2.run(_with_hook, hook):
        assert r["buckets"] == (1 if hook == "powersgd" else 2)
        assert r["compressed"] == (hook == "powersgd")
        # Bit for bit: the same bucket contents go through the same hook on both sides.
        assert r["diffs"] == [0.0] * 4


def _bad_hook(kind: str) -> None:
    ddp = dplab.DDP(nn.Linear(4, 4))
    if kind == "twice":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif kind == "not_future":
        ddp.register_comm_hook(None, lambda state, bucket: bucket.buffer())
        ddp(torch.randn(2, 4)).sum().backward()
    elif kind == "annotation":

        def hook(state: object, bucket: dist.GradBucket) -> torch.Tensor:
            return bucket.buffer()

        ddp.register_comm_hook(None, hook)
    else:
        ddp.register_comm_hook(None, lambda bucket: None)


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("twice", "can only be called once"),
        ("not_future", r"RuntimeError: .*must return a torch.futures.Future"),
        ("arity", r"takes \(state, bucket\)"),
        ("annotation", r"ValueError: .*return annotation should be torch.futures.Future"),
    ],
)
def test_bad_comm_hooks_are_refused(cluster2, kind, message):
    with pytest.raises(dplab.RankError, match=message):
        cluster2.run(_bad_hook, kind)


# -- notebook habits, against torch -----------------------------------------------------------


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    aux: torch.Tensor


class TwoHeads(nn.Module):
    def __init__(self, as_dataclass: bool):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.main = nn.Linear(8, 4)
        self.aux = nn.Linear(8, 4)
        self.as_dataclass = as_dataclass

    def forward(self, x):
        h = torch.relu(self.body(x))
        logits, aux = self.main(h), self.aux(h)
        return Out(logits, aux) if self.as_dataclass else (logits, aux)


def _unused_output(as_dataclass: bool) -> list[float]:
    """A tuple output whose aux head the loss leaves out (torch's DDPSink handles it), or a
    dataclass output (torch finds its tensors for the unused-parameter search). torch raises
    for a dataclass output whose field is left out of the loss (its DDPSink does not see into
    dataclasses), so that case is not compared."""
    torch.manual_seed(0)
    model = TwoHeads(as_dataclass)
    nets = [
        dplab.DDP(model, find_unused_parameters=True),
        nn.parallel.DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True),
    ]
    diffs = []
    for step in range(3):
        x = torch.randn(4, 8, generator=_gen(step))
        for net in nets:
            out = net(x)
            if as_dataclass:
                loss = out.logits.pow(2).mean() + out.aux.mean()
            else:
                loss = out[0].pow(2).mean()
            loss.backward()
        diffs.append(_grad_diff(nets[0].module, nets[1].module))
        if not as_dataclass:  # the aux head got no gradient anywhere: .grad stays None
            assert nets[0].module.aux.weight.grad is None
            assert nets[1].module.aux.weight.grad is None
        for net in nets:
            net.zero_grad()
    return diffs


@pytest.mark.parametrize("as_dataclass", [False, True], ids=["unused-output", "dataclass"])
def test_unused_outputs_and_dataclass_outputs_work_as_in_torch(cluster2, as_dataclass):
    for diffs in cluster2.run(_unused_output, as_dataclass):
        assert diffs == [0.0, 0.0, 0.0]


class Checkpointed(nn.Module):
    """The last layers (the first gradients to be ready) run in a reentrant checkpoint."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(16, 16)
        self.last = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x):
        h = torch.relu(self.first(x))
        return torch.utils.checkpoint.checkpoint(self.last, h, use_reentrant=True)


def _checkpoint() -> list[float]:
    torch.manual_seed(0)
    model = Checkpointed()
    nets = [
        dplab.DDP(model, bucket_cap_mb=0.001),
        nn.parallel.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=0.001),
    ]
    diffs = []
    for step in range(3):
        x = torch.randn(4, 16, generator=_gen(step))
        for net in nets:
            net(x).pow(2).mean().backward()
        diffs.append(_grad_diff(nets[0].module, nets[1].module))
        for net in nets:
            net.zero_grad()
    return diffs


def test_reentrant_checkpoint_around_the_first_ready_parameters(cluster2):
    for diffs in cluster2.run(_checkpoint):
        assert diffs == [0.0, 0.0, 0.0]


class _OneUnused(nn.Module):
    """torch's test_skip_all_reduce_unused_parameters model: fc2 never used, in its own bucket."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(100, 5000, bias=False)
        self.fc2 = nn.Linear(100, 100, bias=False)

    def forward(self, x):
        return self.fc1(x)


def _skip_unused(skip: bool) -> dict:
    torch.manual_seed(31415)
    model = _OneUnused()
    kwargs = {
        "find_unused_parameters": True,
        "bucket_cap_mb": 1.5,
        "skip_all_reduce_unused_params": skip,
    }
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(model), **kwargs)
    ours = dplab.DDP(model, **kwargs)
    for step in range(10):
        x = torch.randn(20, 100, generator=_gen(step))
        for net in (ours, theirs):
            net(x).sum().backward()
    return {
        "reduced": [n._get_ddp_logging_data().get("num_buckets_reduced") for n in (theirs, ours)],
        "buckets": [_torch_buckets(theirs), _ours(ours)],
        "grad_diff": _grad_diff(ours.module, theirs.module),
    }


@pytest.mark.parametrize(("skip", "reduced"), [(False, 2), (True, 1)])
def test_skip_all_reduce_unused_params_skips_the_unused_bucket_as_torch(cluster2, skip, reduced):
    """The bucket of a parameter the forward never reached is not all-reduced (torch's
    ``Reducer::should_skip_all_reduce_bucket``); torch's logging data counts the buckets that
    were, and the gradients stay equal to torch's."""
    for r in cluster2.run(_skip_unused, skip):
        assert r["reduced"] == [reduced, reduced]
        assert r["buckets"][1] == r["buckets"][0] == [["fc2.weight"], ["fc1.weight"]]
        assert r["grad_diff"] == 0.0


class _WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 1)
        self.frozen = nn.Parameter(torch.randn(16), requires_grad=False)
        self.register_buffer("shift", torch.randn(16))

    def forward(self, x):
        assert x.dtype == self.a.weight.dtype == self.shift.dtype == torch.float16
        return self.b(torch.relu(self.a(x) + self.shift + self.frozen))


def _mixed_precision(reduce_dtype: torch.dtype, views: bool, set_to_none: bool) -> dict:
    """dplab.DDP with torch's ``_MixedPrecision`` against the arithmetic of torch's own hook
    (``_reducer_allreduce_and_upcast_hook``), done by hand with plain autograd: a float16 copy
    of the weights runs forward and backward, its gradients are cast to ``reduce_dtype``,
    all-reduced, divided by the world size and cast up to float32."""
    from torch.nn.parallel.distributed import _MixedPrecision

    torch.manual_seed(0)
    model = _WithBuffer()
    config = _MixedPrecision(torch.float16, reduce_dtype, torch.float16)
    ddp = dplab.DDP(copy.deepcopy(model), mixed_precision=config, gradient_as_bucket_view=views)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out: dict = {"diffs": [], "dtypes": set()}
    for step in range(4):
        x = torch.randn(4, 8, generator=_gen(step))
        ddp(x).float().sum().backward()
        half = copy.deepcopy(model).half()
        half(x.half()).float().sum().backward()
        for p, q in zip(model.parameters(), half.parameters(), strict=True):
            if q.grad is not None:
                reduced = q.grad.to(reduce_dtype)
                dist.all_reduce(reduced)
                p.grad = reduced.div_(dist.get_world_size()).float()
        out["diffs"].append(_grad_diff(ddp.module, model))
        out["dtypes"] |= {
            (str(p.dtype), str(p.grad.dtype)) for p in ddp.parameters() if p.grad is not None
        }
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=set_to_none)
    out["weights_equal"] = all(
        torch.equal(p, q) for p, q in zip(ddp.module.parameters(), model.parameters(), strict=True)
    )
    out["twins"] = sorted({str(p._mp_param.dtype) for p in ddp.parameters()})
    return out


@pytest.mark.parametrize("reduce_dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize(("views", "set_to_none"), [(False, True), (False, False), (True, True)])
def test_mixed_precision_reduces_as_torchs_hook(cluster2, reduce_dtype, views, set_to_none):
    for r in cluster2.run(_mixed_precision, reduce_dtype, views, set_to_none):
        assert r["diffs"] == [0.0] * 4  # bit for bit, every step
        assert r["weights_equal"]
        assert r["dtypes"] == {("torch.float32", "torch.float32")}  # the optimizer steps in fp32
        assert r["twins"] == ["torch.float16"]


class _Named(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))  # a root parameter: torch names it ".scale"
        self.lin = nn.Linear(3, 3)
        self.frozen = nn.Linear(3, 3)
        self.frozen.bias.requires_grad_(False)
        self.emb = nn.Embedding(5, 3, sparse=True)

    def forward(self, i):
        return self.frozen(self.lin(self.emb(i) * self.scale))


def _reducer_inputs() -> dict:
    out = {}
    for name, wrapper in (("torch", nn.parallel.DistributedDataParallel), ("dplab", dplab.DDP)):
        torch.manual_seed(0)
        model = _Named()
        wrapper._set_params_and_buffers_to_ignore_for_model(model, ["frozen.weight"])
        ddp = wrapper(model)
        params, sparse = ddp._build_params_for_reducer()
        errors = []
        for wrong in ([*params, nn.Parameter(torch.ones(1))], params[:-1]):
            try:
                ddp._build_debug_param_to_name_mapping(wrong)
            except ValueError as e:
                errors.append(str(e).split(".")[0])
        out[name] = {
            "params": [n for p in params for n, q in model.named_parameters() if p is q],
            "sparse": sparse,
            "names": ddp._build_debug_param_to_name_mapping(params),
            "errors": errors,
        }
    return out


def test_the_reducers_inputs_and_their_names_are_torchs(cluster2):
    """``_build_params_for_reducer`` and ``_build_debug_param_to_name_mapping``, read from torch's
    own DDP on the same model: a root parameter, a frozen one, an ignored one, a sparse one."""
    for r in cluster2.run(_reducer_inputs):
        assert r["dplab"] == r["torch"]
        assert r["torch"]["sparse"] == [False, False, False, True]
        assert len(r["torch"]["errors"]) == 2


class _Branchy(nn.Module):
    """lin2 is used on odd steps, and then only by rank 1 (torch's control-flow tests)."""

    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(10, 10, bias=False)
        self.lin2 = nn.Linear(10, 10, bias=False)

    def forward(self, x, step):
        h = torch.relu(self.lin1(x))
        return self.lin2(h) if step % 2 == 1 and dist.get_rank() == 1 else h


def _reducer_reads() -> dict:
    torch.manual_seed(0)
    model = _Branchy()
    nets = {
        "torch": nn.parallel.DistributedDataParallel(
            copy.deepcopy(model), find_unused_parameters=True
        ),
        "dplab": dplab.DDP(model, find_unused_parameters=True),
    }
    out = {k: {"used": [], "static": [], "buckets": []} for k in nets}
    for step in range(4):
        x = torch.randn(4, 10, generator=_gen(step))
        for name, net in nets.items():
            net(x, step).sum().backward()
            r = out[name]
            r["used"].append(net.reducer._get_local_used_map().tolist())
            r["static"].append(net.reducer._ddp_graph_static())
            buckets = net.reducer._get_zeros_like_grad_buckets()
            r["buckets"].append(
                [(b.index(), b.buffer().abs().sum().item(), b.buffer().numel()) for b in buckets]
            )
    out["rank"] = dist.get_rank()
    try:
        nets["dplab"].reducer._set_static_graph()
    except NotImplementedError as e:
        out["refused"] = str(e)
    return out


def test_ddp_reducer_answers_what_torchs_tests_read(cluster2):
    """``ddp.reducer``'s usage counts, static-graph flag and zero-filled buckets, read from both
    DDPs on a model whose unused set changes with the step and differs across ranks."""
    for r in cluster2.run(_reducer_reads):
        assert r["dplab"] == r["torch"]
        assert r["torch"]["used"] == [[2, 0], [2, 1], [2, 0], [2, 1]]
        # rank 0 never uses lin2: its unused set never changes; rank 1's changes at step 1
        expected = [True] * 4 if r["rank"] == 0 else [True] + [False] * 3
        assert r["torch"]["static"] == expected
        assert r["refused"].startswith("dplab.DDP does not support ddp.reducer._set_static_graph")
