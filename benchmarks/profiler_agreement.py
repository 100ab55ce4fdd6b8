"""How often the Tracer's all-reduce spans agree with torch.profiler's, run after run.

Runs the measurement of tests/test_profiler_agreement.py (Tracer and torch.profiler on the same
20 steps of 2 gloo ranks) again and again on one pair of ranks, and counts the runs in which
both ranks meet the issue's target: the sum of the spans within 5% of the profiler's and 90% of
spans within 10% or 0.2 ms. One run is what CI sees; the rate is what a reader should trust.

    python benchmarks/profiler_agreement.py [--runs 100]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_profiler_agreement import _traced_and_profiled, agreement, paired

import dplab


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    args = parser.parse_args()
    passed, ranks = 0, []
    with dplab.Cluster(2) as cluster:
        for _ in range(args.runs):
            both = True
            for r in cluster.run(_traced_and_profiled):
                ratio, share = agreement(*paired(r))
                ranks.append((ratio, share))
                both &= abs(ratio - 1) <= 0.05 and share >= 0.9
            passed += both
    worst_ratio = max(ranks, key=lambda r: abs(r[0] - 1))[0]
    print(f"runs with both ranks on target: {passed}/{args.runs}")
    print(
        f"per rank: sum {statistics.median(r for r, _ in ranks):.3f}x median, "
        f"{worst_ratio:.3f}x worst; spans close {statistics.median(s for _, s in ranks):.0%} "
        f"median, {min(s for _, s in ranks):.0%} worst"
    )


if __name__ == "__main__":
    main()
