"""Do ZeRO-1's broadcasts pipeline on gloo, or does each pay its latency?

``ZeroRedundancyOptimizer`` ends its step with one broadcast per parameter, from the rank that
owns it, all issued at once (``async_op=True``) and waited for together. This times, on 2 and 4
gloo ranks of this machine, single broadcasts of a few sizes (a barrier before each) and the
burst of the GPT's 29 broadcasts as ZeRO-1 issues them. If the burst took about one transfer of
every weight, the simulator could price it as one all-gather; if it takes about the sum of the
single ones, each broadcast is its own latency (``dplab.sim.sharded``'s ``broadcast=`` fit).

    flock /tmp/dplab-cpu.lock .venv/bin/python benchmarks/zero1_broadcasts.py
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

import dplab
from dplab.sharding.ranks import sharded_model

SIZES = (4096, 65536, 262144, 1048576)


def burst_vs_single(group_size: int, repeats: int = 9) -> dict | None:
    """On every rank: median ms of single broadcasts by size, and of ZeRO-1's burst."""
    rank = dist.get_rank()
    group = dist.new_group(list(range(group_size)))  # every rank takes part in creating it
    if rank >= group_size:
        return None
    out: dict = {}
    for nbytes in SIZES:
        t, times = torch.zeros(nbytes // 4), []
        for _ in range(repeats):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            dist.broadcast(t, src=0, group=group)
            times.append(1e3 * (time.perf_counter() - t0))
        out[nbytes] = statistics.median(times)
    params = list(sharded_model().parameters())
    loads, owner = [0] * group_size, {}
    for i, p in sorted(enumerate(params), key=lambda ip: -ip[1].numel()):  # ZeRO-1's partition
        owner[i] = loads.index(min(loads))
        loads[owner[i]] += p.numel()
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        handles = [
            dist.broadcast(p.data, src=owner[i], group=group, async_op=True)
            for i, p in enumerate(params)
        ]
        for h in handles:
            h.wait()
        times.append(1e3 * (time.perf_counter() - t0))
    out["burst"] = statistics.median(times)
    out["count"] = len(params)
    return out


def main() -> None:
    with dplab.Cluster(4) as cluster:
        for n in (2, 4):
            ranks = [r for r in cluster.run(burst_vs_single, n) if r]
            slowest = {k: max(r[k] for r in ranks) for k in ranks[0]}
            singles = ", ".join(f"{k // 1024} KiB {slowest[k]:.2f} ms" for k in SIZES)
            print(
                f"N={n}: single broadcasts {singles}; the burst of {ranks[0]['count']}: "
                f"{slowest['burst']:.1f} ms = {slowest['burst'] / slowest[SIZES[0]]:.0f} × "
                "one 4 KiB broadcast"
            )


if __name__ == "__main__":
    main()
