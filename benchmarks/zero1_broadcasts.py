"""Do ZeRO-1's broadcasts pipeline on gloo, or does each pay its latency?

``ZeroRedundancyOptimizer`` ends its step with one broadcast per parameter, from the rank that
owns it, all issued at once (``async_op=True``) and waited for together. This times, on 2 and 4
gloo ranks of this machine, single broadcasts of a few sizes (a barrier before each) and that
burst for the GPT's 29 parameters, in torch's owners and order
(:func:`dplab.sharding.unit_profile.zero1_broadcast_ms`). If the burst took about one
transfer of every weight, the simulator could price it as one all-gather; if it took the sum of
the single ones, as many latencies. It takes neither, which is why the unit profile times the
burst whole (``UnitProfile.broadcast_ms``).

    flock /tmp/dplab-cpu.lock .venv/bin/python benchmarks/zero1_broadcasts.py

Writes ``assets/zero1_broadcasts.json``.
"""

from __future__ import annotations

import json
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.distributed as dist

import dplab
from dplab.env import machine_info
from dplab.sharding.ranks import sharded_model
from dplab.sharding.unit_profile import zero1_broadcast_ms

OUT = Path(__file__).resolve().parents[1] / "assets" / "zero1_broadcasts.json"
SIZES = (4096, 65536, 262144, 1048576)


def burst_vs_single(group_size: int, repeats: int = 9) -> dict | None:
    """On every rank: median ms of single broadcasts by size, and of ZeRO-1's burst."""
    group = dist.new_group(list(range(group_size)))  # every rank takes part in creating it
    if dist.get_rank() >= group_size:
        return None
    out: dict = {}
    for nbytes in SIZES:
        t, times = torch.zeros(nbytes // 4), []
        for _ in range(repeats):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            dist.broadcast(t, src=0, group=group)
            times.append(1e3 * (time.perf_counter() - t0))
        out[str(nbytes)] = statistics.median(times)
    out["burst"] = zero1_broadcast_ms(group, group_size, repeats)
    out["count"] = len(list(sharded_model().parameters()))
    return out


def main() -> None:
    rows = []
    with dplab.Cluster(4) as cluster:
        for n in (2, 4):
            ranks = [r for r in cluster.run(burst_vs_single, n) if r]
            slowest = {k: max(r[k] for r in ranks) for k in ranks[0]}  # the slowest rank's
            rows.append({"n": n, **slowest})
            singles = ", ".join(f"{int(k) // 1024} KiB {slowest[str(k)]:.2f} ms" for k in SIZES)
            print(
                f"N={n}: single broadcasts {singles}; the burst of {slowest['count']}: "
                f"{slowest['burst']:.1f} ms = {slowest['burst'] / slowest[str(SIZES[0])]:.0f} × "
                "one 4 KiB broadcast"
            )
    OUT.write_text(json.dumps({
        "kind": "zero1_broadcasts", "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "flock /tmp/dplab-cpu.lock .venv/bin/python benchmarks/zero1_broadcasts.py",
        "machine": machine_info(), "rows": rows}, indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
