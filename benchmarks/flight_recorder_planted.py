"""Planted hangs, read from the flight recorder: is the rank that is behind named right, every run?

Each run is a fresh 2-rank gloo job (``dplab.failures.job``, default group timeout 1 s) in which
rank ``skipper`` never issues all-reduce number ``position`` (``dplab.failures.hangs.skip``), on
the default group or on a new group. The dumps are read by ``dplab doctor --flight-recorder``'s
reader and, on a copy whose ``pg_config`` names the groups, by torch's ``torchfrtrace``. A run
counts as named right when the reader's first mismatch is (rank ``skipper``, collective
``position``, "never issued"), and as agreed when torchfrtrace reports exactly that collective
missing that rank.

    python benchmarks/flight_recorder_planted.py --runs 10 --group default
    python benchmarks/flight_recorder_planted.py --runs 10 --group new
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time
from pathlib import Path

from dplab.doctor.flight_recorder import read_flight_recorder
from dplab.doctor.frtrace import fixed_up_copy, torchfrtrace_verdicts
from dplab.failures.job import run_job

POSITIONS = (1, 2, 3)


def one_run(skipper: int, position: int, new_group: bool) -> tuple[bool, bool]:
    """(named right, torchfrtrace agreed) for one fresh job."""
    with tempfile.TemporaryDirectory(prefix="dplab-fr-") as tmp:
        dumps = Path(tmp) / "fr"
        run_job(
            "skip", folder=dumps, timeout_s=1.0, skipper=skipper, position=position,
            new_group=new_group,
        )  # fmt: skip
        m = read_flight_recorder(dumps).first
        named = m is not None and (m.behind, m.seq, m.kind) == (
            (skipper,),
            position,
            "never issued",
        )
        theirs = torchfrtrace_verdicts(fixed_up_copy(dumps, Path(tmp) / "fixed"))
        agreed = [(v.seq, v.ranks, v.kind) for v in theirs] == [(position, (skipper,), "missing")]
        return named, agreed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--group", choices=("default", "new", "both"), default="both")
    args = parser.parse_args()
    groups = {"default": (False,), "new": (True,), "both": (False, True)}[args.group]
    print("| group | skipper | position | named right | torchfrtrace agrees |")
    print("|---|---|---|---|---|")
    start = time.perf_counter()
    total = named_all = agreed_all = 0
    for new_group, skipper, position in itertools.product(groups, (0, 1), POSITIONS):
        outcomes = [one_run(skipper, position, new_group) for _ in range(args.runs)]
        named = sum(n for n, _ in outcomes)
        agreed = sum(a for _, a in outcomes)
        total, named_all, agreed_all = total + len(outcomes), named_all + named, agreed_all + agreed
        group = "new" if new_group else "default"
        print(f"| {group} | {skipper} | {position} | {named}/{args.runs} | {agreed}/{args.runs} |")
    took = time.perf_counter() - start
    print(f"\nnamed right {named_all}/{total}, torchfrtrace agrees {agreed_all}/{total}")
    print(f"{total} fresh jobs in {took:.0f} s")


if __name__ == "__main__":
    main()
