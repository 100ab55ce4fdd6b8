"""What fresh pages cost, and how often 08f's wide job writes its gradients to them.

08f §3 profiles a job that waits for its all-reduce: two 1024-wide linear layers, 8 MiB of
gradients, one bucket. On a virtual machine its backward can write those gradients to pages the
process never used, and each first write is a page fault: microseconds, and more where the host
has taken the page back. Enough of them and backward outlasts the all-reduce, so the doctor's
verdict names backward; 08f accepts that verdict only with the faults (docs/tracing.md).

1. The cost of a fresh page: map 8 MiB, write one byte per 4 KiB page, time it; repeated.
2. 08f's sequence on fresh ranks, ``--runs`` times: a cluster of 2, the slow-loader job, then
   the wide job (:func:`dplab.doctor.profile_torch_job`), diagnosed. Per run: the page faults of
   the median profiled step on the rank that took the most (as 08f reads them), and the next
   largest part of the step over the exposed communication, on the rank whose backward ended
   last (the verdict flips above 1).

    flock /tmp/dplab-cpu.lock .venv/bin/python benchmarks/fresh_pages.py [--runs 12]
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _stats import machine

import dplab
from dplab.doctor import FRESH_PAGES, diagnose, median_step_faults, profile_torch_job
from dplab.sim import measure_link
from dplab.trace import from_profiler

PAGE = 4096


def fresh_page_us(nbytes: int = 8 << 20, repeats: int = 12) -> list[float]:
    """Microseconds per page to write ``nbytes`` of freshly mapped memory, once per repeat."""
    out = []
    for _ in range(repeats):
        fresh = mmap.mmap(-1, nbytes)
        start = time.perf_counter()
        for offset in range(0, nbytes, PAGE):
            fresh[offset] = 1
        out.append((time.perf_counter() - start) / (nbytes // PAGE) * 1e6)
        fresh.close()
    return out


def one_run() -> tuple[float, float, str]:
    """08f's sequence on fresh ranks: (median-step faults, next largest / exposed, verdict)."""
    with dplab.Cluster(2) as cluster:
        link = measure_link(cluster)
        cluster.run(profile_torch_job, tempfile.mkdtemp(), "mlp", loader_sleep_s=0.04)
        folder = tempfile.mkdtemp()
        wide = cluster.run(profile_torch_job, folder, "wide", bucket_cap_mb=25)
    doctor = diagnose(from_profiler(folder), ddp_logging_data=wide[0]["logging"], reference=link)
    last = doctor.budget.last
    faults = median_step_faults(wide)
    exposed = last["exposed communication"]
    others = max(v for term, v in last.items() if term not in ("step", "exposed communication"))
    return faults, others / exposed, doctor.budget.largest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=12)
    args = p.parse_args()
    costs = fresh_page_us()
    print(f"machine: {machine()}")
    print(f"a fresh page: {statistics.median(costs):.2f} µs (median of {len(costs)} × 8 MiB; "
          f"{min(costs):.2f}-{max(costs):.2f})")  # fmt: skip
    runs = [one_run() for _ in range(args.runs)]
    print("| run | page faults, median step | next largest / exposed | verdict |")
    print("|---|--:|--:|---|")
    for k, (faults, ratio, verdict) in enumerate(runs, 1):
        print(f"| {k} | {faults:.0f} | {ratio:.2f} | {verdict} |")
    for label, group in (
        (f"with ≥ {FRESH_PAGES} faults", [r for r in runs if r[0] >= FRESH_PAGES]),
        (f"with < {FRESH_PAGES}", [r for r in runs if r[0] < FRESH_PAGES]),
    ):
        ratios = [r[1] for r in group]
        span = f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-"
        print(f"{label}: {len(group)} of {len(runs)} runs, next largest / exposed {span}")
    flipped = sum(r[2] != "exposed communication" for r in runs)
    print(f"verdicts not 'exposed communication': {flipped} of {len(runs)}")


if __name__ == "__main__":
    main()
