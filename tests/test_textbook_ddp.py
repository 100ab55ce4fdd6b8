"""The textbook DDP (`dplab/ddp/textbook.py`) is `dplab.DDP(static_buckets=True)`, so torch's.

Pinned on real gloo ranks (``dplab.launch``), at world size 2 and 4, over three steps whose second
is a ``no_sync`` micro-batch followed by a synchronising one:

- the same buckets (index, members in buffer order, bytes, numel, dtype) as dplab.DDP's;
- the same ``.grad`` after every synchronising backward, bit for bit (tolerance 0: the buffers
  are laid out alike, so gloo adds the same numbers in the same order, and both scale by 1/N
  with the same multiplication);
- the same StepObserver calls in the same order (a recording observer), and on a model whose
  gradients fill a later bucket before an earlier one, all-reduces launched in bucket order;
- torch's own DDP: the same ``.grad`` bit for bit at world size 2 (a + b, halved exactly, is the
  same in any bucket layout); at world size 4 on every step where torch's buckets (read from
  ``ddp.reducer._get_zeros_like_grad_buckets()``) equal the textbook's, which they do from its
  rebuild after the first step on a chain of layers (checked);
- a real :class:`dplab.Tracer` draws it: one step per synchronising backward, one all-reduce span
  per bucket;
- a parameter the forward never used is named in an error at the end of backward (its bucket
  never fills, so no rank waits for it).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dplab
from dplab.ddp.textbook import TextbookDDP
from dplab.trace.observer import StepObserver

OBSERVER_CALLS = tuple(name for name in vars(StepObserver) if not name.startswith("_"))
WIDTH = 32


class Shuffled(nn.Module):
    """Six layers whose forward order is not their registration order, with a frozen bias.

    Backward delivers layer 3's gradients first, but bucket 0 holds layer 5 (the last
    registered): a later bucket fills before an earlier one, and must wait to be launched.
    """

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(6))
        self.layers[1].bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in (0, 1, 2, 5, 4, 3):
            x = torch.tanh(self.layers[i](x))
        return x


class Recorder:
    """A StepObserver that writes down every call, with its plain arguments (ints, bools)."""

    def __init__(self):
        self.events: list[tuple] = []

    def __getattr__(self, name: str):
        if name not in OBSERVER_CALLS:
            raise AttributeError(name)

        def record(*args, **kwargs):
            plain = [a for a in args if isinstance(a, int)]
            self.events.append((name, *plain, *sorted(kwargs.items())))

        return record


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "shuffled":
        return Shuffled()
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(6)])


def _batch(step: int, micro: int) -> torch.Tensor:
    seed = 1000 * step + 10 * micro + dist.get_rank()
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(seed))


def _grad_diff(a: nn.Module, b: nn.Module) -> float:
    """The largest |difference| of two models' ``.grad`` (inf if one has a gradient, one not)."""
    worst = 0.0
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        if (p.grad is None) != (q.grad is None):
            return float("inf")
        if p.grad is not None:
            worst = max(worst, (p.grad.double() - q.grad.double()).abs().max().item())
    return worst


def _bucket_record(buckets) -> list[tuple]:
    return [(b.index, b.param_names, b.nbytes, b.numel, b.dtype) for b in buckets]


def _torch_buckets(ddp: nn.parallel.DistributedDataParallel) -> list[tuple[str, ...]]:
    names = {id(p): n for n, p in ddp.module.named_parameters()}
    grad_buckets = ddp.reducer._get_zeros_like_grad_buckets()
    return [tuple(names[id(p)] for p in b.parameters()) for b in grad_buckets]


def _side_by_side(kind: str, caps: dict) -> dict:
    """Three steps of the textbook DDP, dplab.DDP's textbook buckets and torch's DDP, in step."""
    model = _model(kind)
    textbook = TextbookDDP(copy.deepcopy(model), tracer=Recorder(), **caps)
    ours = dplab.DDP(copy.deepcopy(model), static_buckets=True, tracer=Recorder(), **caps)
    cap = caps.get("bucket_cap_mb")
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=cap)
    nets = (textbook, ours, theirs)
    opts = [torch.optim.SGD(net.parameters(), lr=0.1) for net in nets]
    out = {"vs_dplab": [], "vs_torch": [], "torch_same_buckets": []}
    for step in range(3):
        micro_batches = 2 if step == 1 else 1
        for micro in range(micro_batches):
            for net in nets:
                last = micro == micro_batches - 1
                with contextlib.nullcontext() if last else net.no_sync():
                    net(_batch(step, micro)).pow(2).mean().backward()
        out["vs_dplab"].append(_grad_diff(textbook.module, ours.module))
        out["vs_torch"].append(_grad_diff(textbook.module, theirs.module))
        out["torch_same_buckets"].append(
            _torch_buckets(theirs) == [b.param_names for b in textbook.buckets]
        )
        for opt in opts:
            opt.step()
            opt.zero_grad()
    out["buckets"] = _bucket_record(textbook.buckets)
    out["dplab_buckets"] = _bucket_record(ours.buckets)
    out["events"] = textbook.tracer.events
    out["dplab_events"] = ours.tracer.events
    return out


def _traced() -> dict:
    """A real Tracer on the textbook DDP: what it draws."""
    tracer = dplab.Tracer()
    net = TextbookDDP(
        _model("shuffled"), bucket_cap_mb=0.008, first_bucket_cap_mb=0.004, tracer=tracer
    )
    for step in range(2):
        net(_batch(step, 0)).sum().backward()
    steps = tracer.steps
    return {
        "steps": len(steps),
        "buckets_match": all(s.buckets == net.buckets for s in steps),
        # Sorted: the spans are in start order, and gloo's idle workers may begin two
        # consecutive collectives either way round.
        "allreduce": [sorted((s.bucket, s.nbytes) for s in st.of("allreduce")) for st in steps],
        "expected": [(b.index, b.nbytes) for b in net.buckets],
    }


class WithUnused(nn.Module):
    """A layer the forward never calls: its bucket can never fill."""

    def __init__(self):
        super().__init__()
        self.used = nn.Linear(WIDTH, WIDTH)
        self.unused = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def _unused_is_named() -> str:
    net = TextbookDDP(WithUnused())
    try:
        net(_batch(0, 0)).sum().backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def _everything() -> dict:
    """Both models, and the tracer, in one launch (starting ranks is the expensive part)."""
    return {
        "shuffled": _side_by_side(
            "shuffled", {"bucket_cap_mb": 0.008, "first_bucket_cap_mb": 0.004}
        ),
        "chain": _side_by_side("chain", {"bucket_cap_mb": 0.01, "first_bucket_cap_mb": 0.01}),
        "traced": _traced(),
        "unused": _unused_is_named(),
    }


@pytest.fixture(scope="module", params=[2, 4], ids=["N=2", "N=4"])
def runs(request) -> tuple[int, list[dict]]:
    world_size = request.param
    return world_size, dplab.launch(_everything, world_size, backend="gloo")


def _synced_steps(events: list[tuple]) -> list[list[tuple]]:
    """Events split at each ``wait_end`` (the end of a synchronising backward)."""
    steps, current = [], []
    for event in events:
        current.append(event)
        if event[0] == "wait_end":
            steps.append(current)
            current = []
    return steps


def test_same_buckets_as_dplab_ddp_with_static_buckets(runs):
    _, results = runs
    for r in results:
        for kind in ("shuffled", "chain"):
            assert r[kind]["buckets"] == r[kind]["dplab_buckets"]
        assert len(r["shuffled"]["buckets"]) == 4  # layer 5 | 4, 3 | 2, 1 | 0: several buckets
        assert "layers.1.bias" not in sum((b[1] for b in r["shuffled"]["buckets"]), ())


def test_same_grads_as_dplab_ddp_bit_for_bit(runs):
    _, results = runs
    for r in results:
        for kind in ("shuffled", "chain"):
            assert r[kind]["vs_dplab"] == [0.0, 0.0, 0.0]


def test_same_observer_calls_in_the_same_order(runs):
    _, results = runs
    for r in results:
        for kind in ("shuffled", "chain"):
            assert r[kind]["events"] == r[kind]["dplab_events"]
        events = r["shuffled"]["events"]
        assert events.count(("backward_end", ("synced", False))) == 1  # the no_sync micro-batch
        assert events.count(("wait_end",)) == 3


def test_all_reduces_launch_in_bucket_order_though_buckets_fill_out_of_order(runs):
    _, results = runs
    for r in results:
        n = len(r["shuffled"]["buckets"])
        for step in _synced_steps(r["shuffled"]["events"]):
            ready = [e[1] for e in step if e[0] == "bucket_ready"]
            started = [e[1] for e in step if e[0] == "allreduce_start"]
            assert sorted(ready) == list(range(n))
            assert ready != sorted(ready)  # the case this pins: a later bucket filled first
            assert started == list(range(n))


def test_same_grads_as_torch_ddp(runs):
    world_size, results = runs
    for r in results:
        chain = r["chain"]
        # torch starts with one bucket, then rebuilds in arrival order: the textbook's buckets.
        assert chain["torch_same_buckets"] == [False, True, True]
        if world_size == 2:  # any layout: a + b, halved exactly
            assert chain["vs_torch"] == [0.0, 0.0, 0.0]
            assert r["shuffled"]["vs_torch"] == [0.0, 0.0, 0.0]
        else:  # the same layout, the same sums
            assert chain["vs_torch"][1:] == [0.0, 0.0]


def test_a_tracer_draws_the_textbook_ddp(runs):
    _, results = runs
    for r in results:
        traced = r["traced"]
        assert traced["steps"] == 2
        assert traced["buckets_match"]
        assert traced["allreduce"] == [traced["expected"]] * 2


def test_a_parameter_without_a_gradient_is_named_not_waited_for(runs):
    _, results = runs
    for r in results:
        assert "['unused.weight', 'unused.bias']" in r["unused"], r["unused"]
        assert "find_unused_parameters=True" in r["unused"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bucket_cap_mb": 0}, "bucket_cap_mb must be > 0 MiB, got 0"),
        ({"first_bucket_cap_mb": float("nan")}, "first_bucket_cap_mb must be a finite number"),
        ({}, "run it inside dplab.launch"),
    ],
)
def test_bad_arguments_and_no_process_group_are_named(kwargs, message):
    with pytest.raises((ValueError, RuntimeError), match=message):
        TextbookDDP(nn.Linear(2, 2), **kwargs)
