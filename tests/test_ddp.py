"""dplab.DDP against a single-process full-batch run and against torch's own DDP, on real ranks.

Tolerances:
- float64: 1e-12 (measured: 2.8e-17). The only difference from the full batch is the order of
  the sums (per-rank means, then the average of N means): a few ulps of 2.2e-16.
- float32, after 3 SGD steps at lr 0.1: 1e-6 absolute (measured: 1.5e-8, half an ulp at the
  parameters' magnitude of ~0.25; ~8 ulps of 1.2e-7 at magnitude 1 is the bound). The reordered
  sums round differently in the last bit; SGD carries that into the weights. torch DDP shows
  exactly the same error against the full batch (checked below).
- torch DDP: bit for bit at world size 2, where each element's sum is a + b in either order and
  halving is exact. At 3 ranks torch multiplies by 1/3 where dplab divides by 3: last-bit
  differences, within the float tolerance.
"""

from __future__ import annotations

import copy
import hashlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dplab
from dplab.models import make_batch, make_model


@pytest.fixture(scope="module")
def cluster3():
    with dplab.Cluster(3, backend="gloo") as c:
        yield c


def _shard(t: torch.Tensor) -> torch.Tensor:
    return t.chunk(dist.get_world_size())[dist.get_rank()]


def _train(model: nn.Module, wrapper, steps: int, *, dtype=torch.float32, name="mlp", shard=True):
    """SGD on ``name``'s batches; with ``shard`` each rank sees its slice of the global batch."""
    net = wrapper(model) if wrapper else model
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(steps):
        x, y = make_batch(name, 12, seed=step, dtype=dtype)
        if shard:
            x, y = _shard(x), _shard(y)
        net(x, y).backward()
        opt.step()
        opt.zero_grad()
    return net


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b, strict=True))


def _versus_full_batch_and_torch(dtype: torch.dtype, cap_mb: float, textbook: bool = True) -> dict:
    def dp(m):
        if not textbook:  # torch's own buckets
            return dplab.DDP(m, bucket_cap_mb=cap_mb)
        return dplab.DDP(m, bucket_cap_mb=cap_mb, first_bucket_cap_mb=cap_mb)

    def tdp(m):
        return nn.parallel.DistributedDataParallel(m, bucket_cap_mb=cap_mb)

    ours = _params(_train(make_model("mlp", seed=1, dtype=dtype), dp, 3, dtype=dtype).module)
    torchs = _params(_train(make_model("mlp", seed=1, dtype=dtype), tdp, 3, dtype=dtype).module)
    full = _params(
        _train(make_model("mlp", seed=1, dtype=dtype), None, 3, dtype=dtype, shard=False)
    )
    return {
        "vs_full": _max_diff(ours, full),
        "torch_vs_full": _max_diff(torchs, full),
        "vs_torch": _max_diff(ours, torchs),
    }


@pytest.mark.parametrize("cap_mb", [0.001, 25.0])
def test_float64_equals_full_batch_and_torch_at_world_size_2(cluster2, cap_mb):
    for r in cluster2.run(_versus_full_batch_and_torch, torch.float64, cap_mb):
        assert r["vs_full"] < 1e-12
        assert r["vs_torch"] == 0.0


def test_float32_equals_torch_bit_for_bit_and_full_batch_within_rounding(cluster2):
    for r in cluster2.run(_versus_full_batch_and_torch, torch.float32, 0.001):
        assert r["vs_torch"] == 0.0
        assert r["vs_full"] < 1e-6
        assert r["torch_vs_full"] < 1e-6


def test_three_ranks_equal_full_batch_and_torch_bit_for_bit_with_torchs_buckets(cluster3):
    """dplab scales by 1/3 as torch does (x (1/3) while copying). With the textbook variant's
    buckets the elements sit elsewhere in their buffers, gloo sums three values in another
    order, and the last bit may differ; with torch's buckets, nothing differs."""
    for r in cluster3.run(_versus_full_batch_and_torch, torch.float64, 0.001):
        assert r["vs_full"] < 1e-12
        assert r["vs_torch"] < 1e-12
    for r in cluster3.run(_versus_full_batch_and_torch, torch.float32, 0.001):
        assert r["vs_full"] < 1e-6
        assert r["vs_torch"] < 1e-6
    for dtype in (torch.float64, torch.float32):
        for r in cluster3.run(_versus_full_batch_and_torch, dtype, 0.001, False):
            assert r["vs_torch"] == 0.0


def _gpt_versus_torch() -> float:
    def dp(m):
        return dplab.DDP(m, bucket_cap_mb=0.5, first_bucket_cap_mb=0.5)

    def tdp(m):
        return nn.parallel.DistributedDataParallel(m, bucket_cap_mb=0.5)

    ours = _train(make_model("tiny-gpt", seed=3), dp, 3, name="tiny-gpt")
    torchs = _train(make_model("tiny-gpt", seed=3), tdp, 3, name="tiny-gpt")
    return _max_diff(_params(ours.module), _params(torchs.module))


def test_gpt_with_tied_weights_equals_torch_ddp_bit_for_bit(cluster2):
    assert cluster2.run(_gpt_versus_torch) == [0.0, 0.0]


def _replica_hash() -> str:
    model = _train(make_model("tiny-gpt", seed=dist.get_rank()), dplab.DDP, 3, name="tiny-gpt")
    h = hashlib.sha256()
    for p in model.module.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def test_replicas_stay_bit_identical(cluster3):
    hashes = cluster3.run(_replica_hash)  # each rank *built* different weights (seed = rank)
    assert len(set(hashes)) == 1


def _accumulation(micro: int, use_no_sync: bool) -> dict:
    calls = {"n": 0}
    real = dist.all_reduce

    def counting(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    model = dplab.DDP(
        make_model("mlp", seed=1, dtype=torch.float64), bucket_cap_mb=0.01, first_bucket_cap_mb=0.01
    )
    x, y = make_batch("mlp", 24, seed=0, dtype=torch.float64)
    x, y = _shard(x), _shard(y)
    dist.all_reduce = counting
    try:
        for i, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro), strict=True)):
            last = i == micro - 1
            if use_no_sync and not last:
                with model.no_sync():
                    (model(xm, ym) / micro).backward()
            else:
                (model(xm, ym) / micro).backward()
    finally:
        dist.all_reduce = real
    reference = make_model("mlp", seed=1, dtype=torch.float64)
    xf, yf = make_batch("mlp", 24, seed=0, dtype=torch.float64)
    reference(xf, yf).backward()
    return {
        "allreduces": calls["n"],
        "buckets": len(model.buckets),
        "diff": _max_diff(
            [p.grad for p in model.module.parameters()], [p.grad for p in reference.parameters()]
        ),
    }


def test_no_sync_accumulation_equals_the_big_batch_with_one_allreduce_per_bucket(cluster2):
    for r in cluster2.run(_accumulation, 4, True):
        assert r["diff"] < 1e-12
        assert r["allreduces"] == r["buckets"] > 1


def test_forgetting_no_sync_all_reduces_every_micro_batch(cluster2):
    for r in cluster2.run(_accumulation, 4, False):
        assert r["diff"] < 1e-12  # still right, just 4x the communication
        assert r["allreduces"] == 4 * r["buckets"]


def _grads_are_bucket_views() -> list[bool]:
    model = dplab.DDP(
        make_model("tiny-gpt"),
        bucket_cap_mb=0.25,
        first_bucket_cap_mb=0.25,
        gradient_as_bucket_view=True,
    )
    x, y = make_batch("tiny-gpt", 4)
    for _ in range(2):
        model(x, y).backward()
        out = []
        for name, p in model.module.named_parameters():
            buffer = model.bucket_buffers[model.bucket_of(name)]
            start = buffer.data_ptr()
            end = start + buffer.numel() * buffer.element_size()
            out.append(start <= p.grad.data_ptr() < end)
        model.zero_grad(set_to_none=True)
    return out


def test_with_gradient_as_bucket_view_grads_are_views_into_the_bucket_buffers(cluster2):
    for views in cluster2.run(_grads_are_bucket_views):
        assert all(views)


def _buckets_of(name: str, cap: float, first: float) -> list[tuple]:
    model = dplab.DDP(make_model(name), bucket_cap_mb=cap, first_bucket_cap_mb=first)
    return [(b.index, b.param_names, b.numel, b.nbytes, str(b.dtype)) for b in model.buckets]


def test_buckets_follow_reverse_registration_order_with_a_small_first_bucket(cluster2):
    buckets = cluster2.run(_buckets_of, "gpt-7m", 5.0, 1.0)[0]
    model = make_model("gpt-7m")
    names = [n for n, _ in model.named_parameters()]
    flat = [n for b in buckets for n in b[1]]
    assert flat == list(reversed(names))  # tied head.weight is counted once (as tok.weight)
    assert "head.weight" not in flat
    sizes = {n: p.numel() * 4 for n, p in model.named_parameters()}
    first, *rest = buckets
    assert first[3] >= 2**20 and first[3] - sizes[first[1][-1]] < 2**20
    for b in rest[:-1]:
        assert b[3] >= 5 * 2**20 and b[3] - sizes[b[1][-1]] < 5 * 2**20
    assert sum(b[3] for b in buckets) == sum(sizes.values())


class _Mixed(nn.Module):
    """fp32 layer, BatchNorm (buffers), then a bf16 layer: two dtypes, two kinds of bucket."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.b = nn.Linear(8, 8).to(torch.bfloat16)

    def forward(self, x):
        return self.b(self.bn(self.a(x)).to(torch.bfloat16)).float().sum()


def _mixed_frozen_buffers() -> dict:
    torch.manual_seed(dist.get_rank())  # different on every rank: DDP must broadcast rank 0's
    model = _Mixed()
    model.a.bias.requires_grad_(False)
    ddp = dplab.DDP(model, bucket_cap_mb=25)
    ddp(torch.randn(6, 8)).backward()
    return {
        "dtypes": [str(b.dtype) for b in ddp.buckets],
        "names": [b.param_names for b in ddp.buckets],
        "frozen": model.a.bias.detach().clone(),
        "running_mean": model.bn.running_mean.clone(),
        "grad": model.b.weight.grad.float().clone(),
    }


def test_mixed_dtypes_frozen_parameters_and_buffers(cluster2):
    a, b = cluster2.run(_mixed_frozen_buffers)
    assert sorted(a["dtypes"]) == ["torch.bfloat16", "torch.float32"]
    assert all("a.bias" not in names for names in a["names"])  # frozen: not in any bucket
    assert torch.equal(a["frozen"], b["frozen"])  # but broadcast from rank 0
    assert torch.equal(a["grad"], b["grad"])


class _SkipsALayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x).sum()


def _unused(find: bool) -> dict:
    torch.manual_seed(0)
    model = _SkipsALayer()
    ddp = dplab.DDP(model, find_unused_parameters=find)
    ddp(torch.randn(3, 4)).backward()
    if not find:  # as torch: that backward returns, the next forward raises
        ddp(torch.randn(3, 4))
    return {
        "unused_grad": model.unused.weight.grad,
        "used_grad": model.used.weight.grad is not None,
    }


def test_a_parameter_without_gradient_is_named(cluster2):
    with pytest.raises(dplab.RankError, match=r"did not receive grad for rank \d: unused\.weight"):
        cluster2.run(_unused, False)


def test_find_unused_parameters_handles_it_as_torch_does(cluster2):
    for r in cluster2.run(_unused, True):
        assert r["unused_grad"] is None and r["used_grad"]


class _UsedBySome(nn.Module):
    """``b`` is used by rank 1 only, ``c`` by no rank: three answers to "was it used?"."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        y = self.a(x)
        return (self.b(y) if dist.get_rank() == 1 else y).sum()


def _used_by_some() -> list[dict]:
    """Two steps of dplab.DDP and of torch's DDP with ``find_unused_parameters=True``; per
    step, each parameter's ``.grad`` on this rank (None where it has none)."""
    torch.manual_seed(0)
    model = _UsedBySome()
    both = [dplab.DDP(model, find_unused_parameters=True, bucket_cap_mb=1e-4),
            nn.parallel.DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True,
                                                bucket_cap_mb=1e-4)]  # fmt: skip
    out = []
    for step in range(2):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        row = {}
        for name, ddp in zip(("dplab", "torch"), both, strict=True):
            ddp(x).backward()
            row[name] = {n: None if p.grad is None else p.grad.clone()
                         for n, p in ddp.module.named_parameters()}  # fmt: skip
        out.append(row)
    return out


def test_a_parameter_some_ranks_used_is_averaged_and_one_no_rank_used_is_left_as_torch(cluster2):
    """dplab waits for the used counts only at a parameter this rank left unused (as torch's
    finalize_bucket_dense): rank 0 must wait for them at ``b`` and still get rank 1's half."""
    for rank, steps in enumerate(cluster2.run(_used_by_some)):
        for row in steps:
            mine, torch_ = row["dplab"], row["torch"]
            for n in torch_:
                where = f"rank {rank}, {n}"
                assert (mine[n] is None) == (torch_[n] is None), f"{where}: .grad None on one side"
                if mine[n] is not None:
                    assert torch.equal(mine[n], torch_[n]), f"{where}: .grad differs from torch's"
            assert mine["c.weight"] is None and mine["b.weight"] is not None


class _RegisteredBackwards(nn.Module):
    """Layers registered in the opposite order to their use: the reverse-order guess is wrong."""

    def __init__(self):
        super().__init__()
        self.last = nn.Linear(64, 64)
        self.middle = nn.Linear(64, 64)
        self.first = nn.Linear(64, 64)

    def forward(self, x):
        return self.last(self.middle(self.first(x))).sum()


def _rebuild() -> dict:
    torch.manual_seed(0)
    # A Linear(64, 64) holds 16,640 bytes: the first cap fits one layer, the others two.
    ddp = dplab.DDP(
        _RegisteredBackwards(), bucket_cap_mb=0.03, first_bucket_cap_mb=0.0158, rebuild_buckets=True
    )
    before = [set(b.param_names) for b in ddp.buckets]
    for _ in range(2):
        ddp(torch.randn(4, 64)).backward()
    return {"before": before, "after": [set(b.param_names) for b in ddp.buckets]}


def test_rebuild_buckets_follows_the_order_gradients_arrived(cluster2):
    r = cluster2.run(_rebuild)[0]
    assert r["before"] == [  # reversed registration order: the guess is wrong here
        {"first.bias", "first.weight"},
        {"middle.bias", "middle.weight", "last.bias", "last.weight"},
    ]
    assert r["after"] == [  # the order backward really produced: last layer first
        {"last.bias", "last.weight"},
        {"middle.bias", "middle.weight", "first.bias", "first.weight"},
    ]


def _mismatch() -> None:
    width = 4 if dist.get_rank() == 0 else 5
    dplab.DDP(nn.Linear(width, 2))


def test_ranks_with_different_parameters_are_refused(cluster2):
    with pytest.raises(
        dplab.RankError, match=r"rank 0 has 'weight' \[2, 4\].*rank 1 has 'weight' \[2, 5\]"
    ):
        cluster2.run(_mismatch)


def _bad(kind: str) -> None:
    if kind == "frozen":
        m = nn.Linear(2, 2).requires_grad_(False)
        dplab.DDP(m)
    else:
        dplab.DDP(nn.Linear(2, 2), bucket_cap_mb=kind)


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("frozen", "no trainable parameters"),
        (0, "bucket_cap_mb must be > 0"),
        (float("nan"), "bucket_cap_mb must be a finite number"),
        ("25", "bucket_cap_mb must be a finite number"),
    ],
)
def test_bad_input_is_refused(cluster2, kind, message):
    with pytest.raises(dplab.RankError, match=message):
        cluster2.run(_bad, kind)


def _variants() -> float:
    grads = []
    for cls in (dplab.DDP, dplab.PerParameterDDP, dplab.NaiveDDP, dplab.ForwardOrderDDP):
        model = cls(make_model("tiny-gpt", seed=1))
        x, y = make_batch("tiny-gpt", 4, seed=dist.get_rank())
        model(x, y).backward()
        grads.append([p.grad.clone() for p in model.module.parameters()])
    return max(_max_diff(grads[0], g) for g in grads[1:])


def test_teaching_variants_compute_the_same_gradients(cluster2):
    assert cluster2.run(_variants) == [0.0, 0.0]


# -- the textbook variant, by name --------------------------------------------------------------


def _variant_buckets(kwargs: dict) -> dict:
    ddp = dplab.DDP(make_model("mlp"), **kwargs)
    before = [b.param_names for b in ddp.buckets]
    x, y = make_batch("mlp", 4)
    for _ in range(2):
        ddp(x, y).backward()
    return {
        "before": before,
        "after": [b.param_names for b in ddp.buckets],
        "static": ddp.static_buckets,
        "first": ddp.first_bucket_cap_mb,
    }


def test_first_bucket_cap_mb_selects_the_textbook_static_buckets(cluster2):
    names = [n for n, _ in make_model("mlp").named_parameters()]
    textbook = cluster2.run(_variant_buckets, {"bucket_cap_mb": 0.01, "first_bucket_cap_mb": 0.005})
    explicit = cluster2.run(_variant_buckets, {"bucket_cap_mb": 0.01, "static_buckets": True})
    torchs = cluster2.run(_variant_buckets, {"bucket_cap_mb": 0.01})
    for r in (textbook[0], explicit[0]):
        assert r["static"] and r["before"] == r["after"]  # no rebuild
        assert [n for b in r["before"] for n in b] == list(reversed(names))
        assert len(r["before"]) > 1
    assert explicit[0]["first"] == 0.01  # min(cap, 1 MiB) when not chosen
    assert textbook[0]["first"] == 0.005
    assert not torchs[0]["static"] and len(torchs[0]["before"]) == 1  # torch's iteration 0


def _forward_order() -> dict:
    tracer = dplab.Tracer()
    ddp = dplab.ForwardOrderDDP(make_model("mlp"), bucket_cap_mb=0.01, tracer=tracer)
    x, y = make_batch("mlp", 4)
    for _ in range(2):
        ddp(x, y).backward()
    step = tracer.steps[-1]
    end = step.of("backward")[-1].end_ms
    return {
        "buckets": [b.param_names for b in ddp.buckets],
        "first_start_after_backward": min(s.start_ms for s in step.of("allreduce")) - end,
    }


def test_forward_order_buckets_follow_registration_and_start_after_backward(cluster2):
    names = [n for n, _ in make_model("mlp").named_parameters()]
    for r in cluster2.run(_forward_order):
        assert [n for b in r["buckets"] for n in b] == names  # forward order, never rebuilt
        assert len(r["buckets"]) > 1
        assert r["first_start_after_backward"] >= 0  # bucket 0 (the first layer) is ready last


# -- notebook habits ----------------------------------------------------------------------------


def _wrapped_twice() -> dict:
    torch.manual_seed(0)
    model = nn.Linear(4, 2, bias=False).double()
    ddp = dplab.DDP(model)
    with pytest.warns(UserWarning, match="already wrapped"):
        ddp = dplab.DDP(model)  # a re-run notebook cell: the old one is still alive here
    x = torch.arange(8, dtype=torch.float64).view(2, 4) * (dist.get_rank() + 1)
    ddp(x).sum().backward()
    expected = (torch.arange(8, dtype=torch.float64).view(2, 4) * 1.5).sum(0, keepdim=True)
    return {"diff": (model.weight.grad - expected).abs().max().item()}


def test_wrapping_a_module_twice_detaches_the_old_wrapper(cluster2):
    for r in cluster2.run(_wrapped_twice):
        assert r["diff"] == 0.0  # not 0.5x: the first wrapper's hooks are gone


def _old_wrapper_used() -> None:
    model = nn.Linear(4, 2)
    with pytest.warns(UserWarning):
        old = dplab.DDP(model)
        dplab.DDP(model)
    old(torch.randn(1, 4))


def test_the_detached_wrapper_says_so(cluster2):
    with pytest.raises(dplab.RankError, match="detached: its module was wrapped again"):
        cluster2.run(_old_wrapper_used)


def _dropped_wrapper() -> dict:
    import gc

    model = nn.Linear(4, 2)
    ddp = dplab.DDP(model)
    ddp(torch.randn(2, 4)).sum().backward()
    hooks_while_alive = len(model.weight._post_accumulate_grad_hooks or {})
    del ddp
    gc.collect()
    return {
        "alive": hooks_while_alive,
        "after": len(model.weight._post_accumulate_grad_hooks or {}),
    }


def test_a_dropped_wrapper_leaves_no_hooks(cluster2):
    for r in cluster2.run(_dropped_wrapper):
        assert r == {"alive": 1, "after": 0}


class _Flaky(nn.Module):
    """A layer whose backward raises once (an OOM, a bad hook) on every rank."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.fail = False

    def forward(self, x):
        h = self.a(x)
        if self.fail:
            h.register_hook(_raise_once)
        return self.b(torch.tanh(h)).sum()


def _raise_once(grad):
    raise RuntimeError("planted failure in backward")


def _survives_a_failed_backward() -> dict:
    torch.manual_seed(0)
    model = _Flaky().double()
    reference = copy.deepcopy(model)
    ddp = dplab.DDP(model, bucket_cap_mb=0.0002)  # several buckets, some launched before failing
    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    outcome = []
    for fail in (False, True, False):
        model.fail = fail
        ddp.zero_grad()
        try:
            ddp(_shard(x)).backward()
            outcome.append("ok")
        except RuntimeError as e:
            outcome.append(str(e))
    reference(x).backward()
    diff = _max_diff(
        [p.grad * 2 for p in model.parameters()], [p.grad for p in reference.parameters()]
    )
    return {"outcome": outcome, "diff": diff}


def test_an_exception_in_backward_leaves_the_wrapper_usable(cluster2):
    for r in cluster2.run(_survives_a_failed_backward):
        assert r["outcome"][0] == "ok" and r["outcome"][2] == "ok"
        assert "planted failure" in r["outcome"][1]
        assert r["diff"] < 1e-12  # the step after the failure is a correct step


class _LockChecker(dplab.trace.NullObserver):
    """Records whether the DDP held its lock whenever a hook told the observer something."""

    def attach(self, ddp):
        self.ddp, self.held = ddp, []

    def grad_ready(self, index):
        self.held.append(self.ddp._lock.locked())

    def allreduce_start(self, bucket):
        self.held.append(self.ddp._lock.locked())


def _hooks_hold_the_lock() -> list[bool]:
    checker = _LockChecker()
    ddp = dplab.DDP(make_model("mlp"), tracer=checker, bucket_cap_mb=0.001)
    x, y = make_batch("mlp", 4)
    for _ in range(2):
        ddp(x, y).backward()
    return checker.held


def test_hook_state_changes_under_a_lock(cluster2):
    """Autograd runs CPU and CUDA parameters' hooks on different threads: every change of the
    DDP's per-step state happens under its lock."""
    for held in cluster2.run(_hooks_hold_the_lock):
        assert held and all(held)


class _Sent(dplab.trace.NullObserver):
    def attach(self, ddp):
        self.sent = []

    def allreduce_launched(self, bucket, work, nbytes):
        self.sent.append((bucket, type(work).__name__, nbytes))


def _hooked_bytes() -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    watcher = _Sent()
    ddp = dplab.DDP(make_model("mlp"), tracer=watcher)
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    x, y = make_batch("mlp", 4)
    ddp(x, y).backward()
    return {"sent": watcher.sent, "bucket_bytes": [b.nbytes for b in ddp.buckets]}


def test_a_hooked_bucket_reports_the_bytes_its_hook_sent(cluster2):
    r = cluster2.run(_hooked_bytes)[0]
    assert [nbytes for _, _, nbytes in r["sent"]] == [n // 2 for n in r["bucket_bytes"]]  # fp16
    assert all(kind == "Future" for _, kind, _ in r["sent"])


class _Config:
    def __init__(self, **fields):
        self.__dict__.update(fields)


def _refused(kind: str) -> None:
    kwargs = {
        "mixed_precision": {"mixed_precision": object()},
        "mixed_dtype": {"mixed_precision": _Config(param_dtype="float16")},
        "delay": {"delay_all_reduce_named_params": [("w", object())]},
        "device_ids": {"device_ids": [0]},
        "two_device_ids": {"device_ids": [0, 1]},
    }[kind]
    dplab.DDP(nn.Linear(2, 2), **kwargs)


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("mixed_precision", "mixed_precision=<object object at .*> has no param_dtype"),
        ("mixed_dtype", "mixed_precision.param_dtype must be a torch.dtype or None, got 'float16'"),
        ("delay", "does not support delay_all_reduce_named_params="),
        ("device_ids", "device_ids and output_device arguments only work with"),
        ("two_device_ids", "device_ids can only be None or contain a single element"),
    ],
)
def test_unsupported_or_bad_torch_arguments_are_refused_by_name(cluster2, kind, message):
    with pytest.raises(dplab.RankError, match=message):
        cluster2.run(_refused, kind)


def _traced_hook() -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    tracer = dplab.Tracer()
    ddp = dplab.DDP(make_model("mlp"), bucket_cap_mb=0.01, tracer=tracer)
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt = tracer.watch(torch.optim.SGD(ddp.parameters(), lr=0.1))
    x, y = make_batch("mlp", 4)
    for _ in range(3):
        ddp(x, y).backward()
        opt.step()
        opt.zero_grad()
    last = tracer.steps[-1]
    spans = last.of("allreduce")
    return {
        "spans": [(s.bucket, s.nbytes, s.end_ms >= s.start_ms) for s in spans],
        "bucket_bytes": [b.nbytes for b in ddp.buckets],
    }


def test_the_tracer_shows_a_hooked_buckets_span_and_the_bytes_it_sent(cluster2):
    r = cluster2.run(_traced_hook)[0]
    assert len(r["bucket_bytes"]) > 1
    assert sorted(b for b, _, _ in r["spans"]) == list(range(len(r["bucket_bytes"])))
    assert all(ok for _, _, ok in r["spans"])
    assert {b: n for b, n, _ in r["spans"]} == {
        b: n // 2 for b, n in enumerate(r["bucket_bytes"])
    }  # fp16 on the wire


def _views_kept_versus_torch() -> float:
    """With views and zero_grad(set_to_none=False), torch divides each slot by N in place; at
    N = 3 that differs in the last bit from multiplying by 1/3, so this tells the two apart."""
    nets = [
        dplab.DDP(make_model("mlp", seed=1), gradient_as_bucket_view=True, bucket_cap_mb=0.01),
        nn.parallel.DistributedDataParallel(
            make_model("mlp", seed=1), gradient_as_bucket_view=True, bucket_cap_mb=0.01
        ),
    ]
    opts = [torch.optim.SGD(n.parameters(), lr=0.1) for n in nets]
    for step in range(3):
        x, y = make_batch("mlp", 12, seed=step)
        for net, opt in zip(nets, opts, strict=True):
            net(_shard(x), _shard(y)).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
    return _max_diff(_params(nets[0].module), _params(nets[1].module))


def test_three_ranks_with_views_kept_between_steps_equal_torch_bit_for_bit(cluster3):
    assert cluster3.run(_views_kept_versus_torch) == [0.0, 0.0, 0.0]
