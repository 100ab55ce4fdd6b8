"""``python -m tests.conformance run|table``: run torch's DDP tests on both DDPs, write the table.

``run`` goes on where the results file stops, and stops starting tests after ``--budget-s``
(so that each call holds the CPU lock a few minutes at most); it prints ``nothing left`` when
every (test, DDP, world size, mode) has a result. dplab is run on a test only where torch's DDP
passed it in the same world size and mode (elsewhere the test does not count).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tests.conformance.report import markdown
from tests.conformance.runner import REPO, Pool, Result, append, load

RESULTS = REPO / "tests" / "conformance" / "results.jsonl"
TABLE = REPO / "docs" / "ddp-conformance.md"


def pending(results: dict, tests: list[str], worlds: list[int]) -> list[tuple[str, int, bool, str]]:
    """(ddp, world, shim, test) still to run, grouped so that one pool serves many tests."""
    todo = []
    for w in worlds:
        for shim in (False, True):
            for t in tests:
                direct = results.get((t, "torch", w, False))
                if shim and direct is not None and direct.outcome != "skip":
                    continue  # ran directly: the shim adds nothing
                torch_r = results.get((t, "torch", w, shim))
                if torch_r is None:
                    todo.append(("torch", w, shim, t))
                elif torch_r.outcome == "pass" and (t, "dplab", w, shim) not in results:
                    todo.append(("dplab", w, shim, t))
    return sorted(todo, key=lambda x: (x[0] != "torch", x[1], x[2]))


def run(args: argparse.Namespace) -> None:
    from tests.conformance.suite import ddp_tests

    tests = args.tests or ddp_tests()
    start, pool = time.monotonic(), None
    try:
        while time.monotonic() - start < args.budget_s:
            todo = [x for x in pending(load(args.results), tests, args.world) if x[0] in args.ddp]
            if not todo:
                print("nothing left")
                return
            ddp, w, shim, t = todo[0]
            if pool is None or (pool.ddp, pool.world, pool.shim) != (ddp, w, shim):
                if pool is not None:
                    pool.close()
                pool = Pool(ddp, w, shim)
            r: Result = pool.run(t)
            append(args.results, r)
            print(f"{ddp:5} w={w} {'shim' if shim else 'direct':6} {r.outcome:8} {t}", flush=True)
        left = [x for x in pending(load(args.results), tests, args.world) if x[0] in args.ddp]
        print(f"budget spent; {len(left)} left")
    finally:
        if pool is not None:
            pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.conformance")
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run what the results file lacks")
    r.add_argument("--world", type=int, nargs="+", default=[2, 3])
    r.add_argument("--tests", nargs="*", default=None)
    r.add_argument("--ddp", nargs="+", default=["torch", "dplab"], choices=["torch", "dplab"])
    r.add_argument("--budget-s", type=float, default=150.0)
    r.add_argument("--results", type=Path, default=RESULTS)
    t = sub.add_parser("table", help="write the markdown table")
    t.add_argument("--results", type=Path, default=RESULTS)
    t.add_argument("--out", type=Path, default=TABLE)
    args = parser.parse_args()
    if args.cmd == "run":
        run(args)
    else:
        args.out.write_text(markdown(load(args.results)))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
