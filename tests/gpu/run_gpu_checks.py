"""The one script to run on a lent GPU (one H200 here): the CUDA paths of dplab, checked.

    python tests/gpu/run_gpu_checks.py --out "$OUT/gpu-results.json"

One GPU cannot host two NCCL ranks, and NCCL at world size 1 launches no kernel for an in-place
all-reduce (it is a no-op), so a profiler finds nothing to time there. What one GPU can prove:

1. stream ordering (:mod:`tests.gpu.ordering`): a stand-in collective (a comm hook that sleeps
   and scales the bucket on a side stream) against a synchronous reference, bit for bit, and two
   negative controls (a Future completed before the work; a side stream that does not wait for
   the launching one) that the same comparison must catch;
2. CUDA-event spans (:mod:`tests.gpu.kernels`): each bucket's all-reduce span of dplab.Tracer
   (CUDA events, NCCL clock) against the stand-in's kernel times in torch.profiler's trace,
   within 5% or 50 µs;
3. two gloo ranks with CUDA tensors on the one GPU: dplab.DDP equals torch DDP bit for bit and
   the full batch within 1e-5;
4. NCCL at world size 1: dplab.DDP equals torch DDP bit for bit (the CUDA plumbing only: the
   collective itself is a no-op);
5. memory (tests/gpu/check_memory.py): bytes/param of mixed-precision AdamW state, and
   torch.cuda.max_memory_allocated during a step;
6. torch's native ``mixed_precision`` (which needs CUDA events: torch's own DDP cannot run it on
   CPU) and sparse gradients: two gloo ranks with CUDA tensors, dplab.DDP against torch DDP,
   gradients and weights bit for bit.

Each check returns its figures; the script writes them as JSON and exits non-zero on a failure.
The parts that need no GPU run in CI (tests/gpu/test_gpu_logic.py). Record each run, with date
and hardware, in docs/gpu-results.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import traceback
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
from torch import nn

import dplab
from dplab.models import make_batch, make_model
from tests.gpu import kernels, ordering


def train_pair(device_type: str, cap_mb: float = 0.5, steps: int = 3) -> dict:
    """dplab.DDP and torch DDP side by side on this rank's device; largest parameter gaps."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    ours = dplab.DDP(make_model("tiny-gpt", seed=1).to(device), bucket_cap_mb=cap_mb)
    ids = [device.index] if device.type == "cuda" else None
    theirs = nn.parallel.DistributedDataParallel(
        make_model("tiny-gpt", seed=1).to(device), device_ids=ids, bucket_cap_mb=cap_mb
    )
    full = make_model("tiny-gpt", seed=1).to(device)
    nets = {"dplab": ours, "torch": theirs, "full": full}
    opts = {k: torch.optim.SGD(v.parameters(), lr=0.1) for k, v in nets.items()}
    for step in range(steps):
        x, y = make_batch("tiny-gpt", 4 * world, seed=step)
        x, y = x.to(device), y.to(device)
        shard = slice(rank * 4, rank * 4 + 4)
        for name, net in nets.items():
            xs, ys = (x, y) if name == "full" else (x[shard], y[shard])
            net(xs, ys).backward()
            opts[name].step()
            opts[name].zero_grad()

    def params(m: nn.Module) -> list[torch.Tensor]:
        return [p.detach().double() for p in m.parameters()]

    def gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
        return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))

    return {
        "device": str(device),
        "dplab_vs_torch": gap(params(ours.module), params(theirs.module)),
        "dplab_vs_full_batch": gap(params(ours.module), params(full)),
    }


def judge_pair(results: list[dict]) -> dict:
    for r in results:
        assert r["dplab_vs_torch"] == 0.0, r
        assert r["dplab_vs_full_batch"] < 1e-5, r
    return {"ranks": results}


# -- 1. stream ordering ------------------------------------------------------------------------


def _ordering() -> dict:
    streams = ordering.CudaStreams(torch.device("cuda", 0))
    return {v: ordering.run_variant(streams, v) for v in ordering.VARIANTS}


def check_stream_ordering() -> dict:
    return ordering.judge(dplab.launch(_ordering, 1, backend="nccl")[0])


# -- 2. CUDA-event spans against the profiler's kernel times -----------------------------------


def _events_vs_kernels(sleep_ms: float = 2.0, steps: int = 3) -> dict:
    from torch.profiler import ProfilerActivity, profile

    streams = ordering.CudaStreams(torch.device("cuda", 0))
    tracer = dplab.Tracer()
    ddp = ordering.stand_in_ddp(streams, "honest", sleep_ms, slow_backward_ms=0.0, tracer=tracer)
    batches = [(x.cuda(), y.cuda()) for x, y in ordering.make_batches(steps + 2)]
    for x, y in batches[:2]:  # warm-up, and the rebuild of the buckets
        ddp(x, y).backward()
    torch.cuda.synchronize()
    tracer.clear()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for x, y in batches[2:]:
            ddp(x, y).backward()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    steps_ = tracer.steps
    ours = [s.duration_ms * 1e3 for t in steps_ for s in sorted(t.of("allreduce"), key=_start)]
    theirs = [end - start for start, end in kernels.kernel_spans(trace)]
    return {"clock": steps_[-1].clock, "dplab_us": ours, "profiler_us": theirs}


def _start(span: dplab.trace.Span) -> float:
    return span.start_ms


def judge_events(r: dict) -> dict:
    assert r["clock"] == "cuda_event", r
    bad = kernels.mismatches(r["dplab_us"], r["profiler_us"])
    assert not bad, f"spans outside 5% or 50 µs of the kernel times: {bad}"
    return r


def check_cuda_events_against_profiler() -> dict:
    return judge_events(dplab.launch(_events_vs_kernels, 1, backend="nccl")[0])


# -- 3, 4. bit-for-bit against torch DDP --------------------------------------------------------


def check_gloo_with_cuda_tensors() -> dict:
    return judge_pair(dplab.launch(train_pair, 2, backend="gloo", args=("cuda",)))


def check_nccl_world_size_1() -> dict:
    return judge_pair(dplab.launch(train_pair, 1, backend="nccl", args=("cuda",)))


# -- 5. memory ---------------------------------------------------------------------------------


def check_memory_on_gpu() -> dict:
    from tests.gpu.check_memory import check_memory

    return check_memory()


# -- 6. mixed precision and sparse gradients ---------------------------------------------------


class SparseNet(nn.Module):
    """A sparse embedding (its own bucket, a sparse all-reduce) before a dense head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 16, sparse=True)
        self.head = nn.Linear(16, 1)

    def forward(self, i: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(i).mean(1))


def _gap(a: nn.Module, b: nn.Module, grads: bool) -> float:
    worst = 0.0
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        x, y = (p.grad, q.grad) if grads else (p.detach(), q.detach())
        if x is None or y is None:
            if (x is None) != (y is None):
                return float("inf")
            continue
        x, y = (t.to_dense() if t.is_sparse else t for t in (x, y))
        worst = max(worst, (x.double() - y.double()).abs().max().item())
    return worst


def _side_by_side(
    make: Any, batch: Any, steps: int = 3, device_type: str = "cuda", **kwargs: Any
) -> dict:
    """The same model under both DDPs on cuda:0 (or the CPU); worst gradient and weight gaps
    over ``steps``."""
    cuda, rank = device_type == "cuda", dist.get_rank()
    device, ids = (torch.device("cuda", 0), [0]) if cuda else (torch.device("cpu"), None)
    torch.manual_seed(0)
    base = make().to(device)
    ours = dplab.DDP(copy.deepcopy(base), device_ids=ids, **kwargs)
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base), device_ids=ids, **kwargs)
    opts = [torch.optim.SGD(n.parameters(), lr=0.1) for n in (ours, theirs)]
    out = {"grad_gap": 0.0, "weight_gap": 0.0, "grad_dtypes": set()}
    for step in range(steps):
        x = batch(torch.Generator().manual_seed(100 * step + rank)).to(device)
        for net in (ours, theirs):
            net(x).float().pow(2).mean().backward()
        out["grad_gap"] = max(out["grad_gap"], _gap(ours.module, theirs.module, grads=True))
        out["grad_dtypes"] |= {str(p.grad.dtype) for p in ours.parameters() if p.grad is not None}
        for opt in opts:
            opt.step()
            opt.zero_grad()
        out["weight_gap"] = max(out["weight_gap"], _gap(ours.module, theirs.module, grads=False))
    out["grad_dtypes"] = sorted(out["grad_dtypes"])
    return out


def sparse_ids(g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 100, (8, 5), generator=g)


def sparse_side_by_side(device_type: str) -> dict:
    return {"sparse": _side_by_side(SparseNet, sparse_ids, device_type=device_type)}


def _mixed_and_sparse() -> dict:
    from torch.nn.parallel.distributed import _MixedPrecision

    def mlp() -> nn.Module:
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))

    def dense(g: torch.Generator) -> torch.Tensor:
        return torch.randn(16, 32, generator=g)

    out = {}
    for reduce in (torch.float16, torch.float32):
        config = _MixedPrecision(torch.float16, reduce, torch.float16)
        out[f"mixed_fp16_reduce_{reduce}"] = _side_by_side(mlp, dense, mixed_precision=config)
    return out | sparse_side_by_side("cuda")


def judge_mixed_and_sparse(results: list[dict]) -> dict:
    for r in results:
        for case, figures in r.items():
            assert figures["grad_gap"] == 0.0 and figures["weight_gap"] == 0.0, (case, figures)
            assert figures["grad_dtypes"] == ["torch.float32"], (case, figures)
    return {"ranks": results}


def check_mixed_precision_and_sparse_against_torch() -> dict:
    return judge_mixed_and_sparse(dplab.launch(_mixed_and_sparse, 2, backend="gloo"))


CHECKS = [
    check_stream_ordering,
    check_cuda_events_against_profiler,
    check_gloo_with_cuda_tensors,
    check_nccl_world_size_1,
    check_memory_on_gpu,
    check_mixed_precision_and_sparse_against_torch,
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="gpu-results.json")
    p.add_argument("--only", nargs="*", help="names of the checks to run (default: all)")
    args = p.parse_args(argv)
    chosen = [c for c in CHECKS if not args.only or c.__name__ in args.only]
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "checks": {},
    }
    failed = False
    for check in chosen:
        try:
            report["checks"][check.__name__] = {"ok": True, "figures": check()}
        except Exception:
            failed = True
            report["checks"][check.__name__] = {"ok": False, "error": traceback.format_exc()}
    text = json.dumps(report, indent=2, default=str)
    Path(args.out).write_text(text)
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
