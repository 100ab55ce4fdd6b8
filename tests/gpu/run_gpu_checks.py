"""The one script to run on a lent GPU (one H200 here): every CUDA path of dplab, checked.

    python tests/gpu/run_gpu_checks.py --out "$OUT/gpu-results.json"

One GPU cannot host two NCCL ranks, so the checks are:
1. NCCL at world size 1: dplab.DDP on cuda:0 equals torch DDP bit for bit and the full batch.
2. Two gloo ranks with CUDA tensors on the one GPU: dplab.DDP equals torch DDP bit for bit.
3. CUDA-event traces: each bucket's all-reduce span (dplab.Tracer, NCCL) against the NCCL kernel
   times that torch.profiler records, within 5% or 50 µs.
4. Memory: bytes/param of mixed-precision AdamW state, and torch.cuda.max_memory_allocated with
   activations (tests/gpu/check_memory.py).
Each check returns its figures; the script prints them as JSON and exits non-zero on a failure.
Record the results, with date and hardware, in docs/gpu-results.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
from torch import nn

import dplab
from dplab.models import make_batch, make_model


def _train_pair(device: torch.device, cap_mb: float, steps: int = 3) -> dict:
    """dplab.DDP and torch DDP side by side on ``device``; largest parameter difference."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ours = dplab.DDP(
        make_model("tiny-gpt", seed=1).to(device), bucket_cap_mb=cap_mb, first_bucket_cap_mb=cap_mb
    )
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

    def params(m):
        return [p.detach().double() for p in m.parameters()]

    def diff(a, b):
        return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))

    return {
        "dplab_vs_torch": diff(params(ours.module), params(theirs.module)),
        "dplab_vs_full_batch": diff(params(ours.module), params(full)),
    }


def _nccl_world_size_1() -> dict:
    return _train_pair(torch.device("cuda", 0), cap_mb=0.5)


def check_nccl_world_size_1() -> dict:
    r = dplab.launch(_nccl_world_size_1, 1, backend="nccl")[0]
    assert r["dplab_vs_torch"] == 0.0, r
    assert r["dplab_vs_full_batch"] < 1e-5, r
    return r


def _gloo_cuda() -> dict:
    return _train_pair(torch.device("cuda", 0), cap_mb=0.5)


def check_gloo_with_cuda_tensors() -> dict:
    out = dplab.launch(_gloo_cuda, 2, backend="gloo")
    for r in out:
        assert r["dplab_vs_torch"] == 0.0, r
        assert r["dplab_vs_full_batch"] < 1e-5, r
    return {"ranks": out}


def _events_vs_profiler() -> dict:
    from torch.profiler import ProfilerActivity, profile

    device = torch.device("cuda", 0)
    tracer = dplab.Tracer()
    model = dplab.DDP(
        make_model("gpt-7m").to(device), bucket_cap_mb=5, first_bucket_cap_mb=5, tracer=tracer
    )
    x, y = (t.to(device) for t in make_batch("gpt-7m", 8))
    for _ in range(3):
        model(x, y).backward()
    torch.cuda.synchronize()
    tracer.clear()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model(x, y).backward()
        torch.cuda.synchronize()
    step = tracer.steps[-1]
    ours = [s.duration_ms * 1e3 for s in step.of("allreduce")]
    kernels = sorted(
        (e for e in prof.events() if e.device_type.name == "CUDA" and "nccl" in e.name.lower()),
        key=lambda e: e.time_range.start,
    )
    theirs = [e.time_range.elapsed_us() for e in kernels]
    return {"dplab_us": ours, "profiler_us": theirs, "clock": step.clock}


def check_cuda_events_against_profiler() -> dict:
    r = dplab.launch(_events_vs_profiler, 1, backend="nccl")[0]
    assert r["clock"] == "cuda_event", r
    assert len(r["dplab_us"]) == len(r["profiler_us"]), r
    for ours, theirs in zip(r["dplab_us"], r["profiler_us"], strict=True):
        assert abs(ours - theirs) <= max(50.0, 0.05 * theirs), (ours, theirs)
    return r


def check_memory_on_gpu() -> dict:
    from tests.gpu.check_memory import check_memory

    return check_memory()


CHECKS = [
    check_nccl_world_size_1,
    check_gloo_with_cuda_tensors,
    check_cuda_events_against_profiler,
    check_memory_on_gpu,
]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="gpu-results.json")
    args = p.parse_args()
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "checks": {},
    }
    failed = False
    for check in CHECKS:
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
