"""``python -m dplab check``: what this machine offers, and proof that ranks can all-reduce."""

from __future__ import annotations

import argparse
import sys

from dplab.cli._args import CliError, check_ranks, fail, launched_world_size, world_size


def _check_allreduce() -> float:
    import torch
    import torch.distributed as dist

    import dplab

    t = torch.tensor([float(dist.get_rank() + 1)], device=dplab.device())
    dist.all_reduce(t)
    return t.item()


def cmd_check(args: argparse.Namespace) -> int:
    """Print what this machine offers and prove that ranks can all-reduce."""
    n = launched_world_size(args.world_size)  # under torchrun (cluster -- check): its ranks
    try:
        world_size("--world-size", n)
        check_ranks(n)
    except CliError as e:
        return fail(str(e))
    import platform

    import torch
    import torch.distributed as dist

    import dplab
    from dplab.env import gpu_count, resolve_backend

    print(
        f"dplab {dplab.__version__}, torch {torch.__version__}, Python {platform.python_version()}"
    )
    backends = [
        n
        for n, ok in [
            ("gloo", dist.is_gloo_available()),
            ("nccl", dist.is_nccl_available()),
            ("mpi", dist.is_mpi_available()),
        ]
        if ok
    ]
    print(f"torch.distributed backends: {', '.join(backends) or 'none'}")
    gpus = gpu_count()
    names = [torch.cuda.get_device_name(i) for i in range(gpus)]
    print(f"GPUs: {gpus}" + (f" ({', '.join(names)})" if names else ""))
    backend = resolve_backend(args.backend, n)
    print(f"running a {n}-rank all-reduce on {backend} ...", flush=True)
    try:
        out = dplab.launch(_check_allreduce, n, backend=backend, timeout_s=120)
    except Exception as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    expected = n * (n + 1) / 2
    if any(s != expected for s in out):
        print(f"FAILED: all-reduce gave {out}, expected {expected} on every rank", file=sys.stderr)
        return 1
    print(f"ok: every rank holds {expected:g} = 1 + … + {n}")
    return 0


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="environment check and a real all-reduce")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    p.set_defaults(func=cmd_check)
