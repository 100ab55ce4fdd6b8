"""How long ranks take to start and to answer.

Targets: ``Cluster.run`` of a trivial function on 2 warm ranks < 50 ms median; a cold ``launch``
of 2 ranks < 4 s on a quiet 2-core machine.

    python benchmarks/launch.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _stats import machine

import dplab


def trivial() -> int:
    return 1


def main() -> None:
    cold = []
    for _ in range(5):
        t0 = time.perf_counter()
        dplab.launch(trivial, 2)
        cold.append(time.perf_counter() - t0)
    with dplab.Cluster(2) as cluster:
        warm = []
        for _ in range(200):
            t0 = time.perf_counter()
            cluster.run(trivial)
            warm.append(time.perf_counter() - t0)
    print(f"machine: {machine()}")
    print(
        f"cold launch of 2 ranks: median {statistics.median(cold):.2f} s "
        f"(min {min(cold):.2f}, max {max(cold):.2f}, n={len(cold)})"
    )
    print(
        f"Cluster.run on 2 warm ranks: median {statistics.median(warm) * 1e3:.2f} ms "
        f"(p90 {sorted(warm)[int(0.9 * len(warm))] * 1e3:.2f} ms, n={len(warm)})"
    )


if __name__ == "__main__":
    main()
