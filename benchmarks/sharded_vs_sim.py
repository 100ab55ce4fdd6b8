"""The sharded-step simulator against measured steps: DDP, ZeRO-1, ZeRO-2-like and ZeRO-3 on 2 and
4 gloo ranks of this machine, the same GPT as notebook 09b.

Each round, for N = 2 and 4 in turn: calibrate on the same warm ranks
(:func:`dplab.sharding.unit_profile.unit_profile`: each unit's forward and backward, each
method's own optimizer step, ZeRO-1's burst of broadcasts, each FSDP2 unit's all-gather,
all-reduce and all-gather times for the α-β fits), then time every method's bare steps
(:func:`dplab.sharding.step_time.timed_step`), the methods in a rotating order. A step counts
as its slowest rank; a method's measured time is the median over every step of every round.
The prediction is :func:`dplab.sim.sharded.simulate_sharded` from each round's calibration,
gloo's prices (a reduce-scatter is an all-reduce; ZeRO-1's broadcasts and FSDP2's all-gathers
as measured), with and without prefetch overlap; its median over rounds is compared.

    flock /tmp/dplab-cpu.lock .venv/bin/python benchmarks/sharded_vs_sim.py [--rounds 5]

Writes ``assets/sharded_vs_sim.json`` and prints a markdown table (docs/benchmarks.md's section
"Sharded step: simulator vs measured" is that table, pasted by hand).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import UTC, datetime
from pathlib import Path

import dplab
from dplab.env import machine_info
from dplab.sharding import METHODS
from dplab.sharding.step_time import timed_step
from dplab.sharding.unit_profile import unit_profile
from dplab.sim.sharded import links_from_ranks, simulate_sharded, unit_profile_from_ranks

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "assets" / "sharded_vs_sim.json"
COMMAND = "flock /tmp/dplab-cpu.lock .venv/bin/python benchmarks/sharded_vs_sim.py"


def one_round(cluster: dplab.Cluster, n: int, k: int) -> dict:
    """Calibrate, predict, then measure every method once at world size ``n``."""
    raw = cluster.run(unit_profile, group_size=n)
    profile = unit_profile_from_ranks(raw)
    ar, ag = links_from_ranks(raw)
    predicted = {
        f"{m}/{'prefetch' if pre else 'serial'}": simulate_sharded(
            profile, m, ar, n, backend="gloo", prefetch=pre, gather_link=ag
        ).step_ms
        for m in METHODS
        for pre in (True, False)
    }
    measured = {}
    for m in METHODS[k % 4 :] + METHODS[: k % 4]:  # a rotating order
        per_rank = [r for r in cluster.run(timed_step, m, group_size=n) if r]
        measured[m] = [max(col) for col in zip(*per_rank, strict=True)]
    return {
        "n": n,
        "predicted": predicted,
        "measured": measured,
        "compute_ms": profile.compute_ms,
        "optimizer_ms": profile.optimizer_ms,
        "zero1_broadcast_ms": profile.broadcast_ms.get(n),
        "gather_ms": profile.gather_ms.get(n),
        "link": ar.to_dict(),
        "gather_link": ag.to_dict(),
    }


def summarise(rounds: list[dict]) -> list[dict]:
    rows = []
    for n in sorted({r["n"] for r in rounds}):
        mine = [r for r in rounds if r["n"] == n]
        for m in METHODS:
            measured = statistics.median(t for r in mine for t in r["measured"][m])
            row = {"n": n, "method": m, "measured_ms": measured}
            for mode in ("prefetch", "serial"):
                p = statistics.median(r["predicted"][f"{m}/{mode}"] for r in mine)
                row[f"{mode}_ms"] = p
                row[f"{mode}_error"] = p / measured - 1
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    rounds = []
    with dplab.Cluster(4, backend="gloo") as cluster:
        for k in range(args.rounds):
            for n in (2, 4):
                rounds.append(one_round(cluster, n, k))
    rows = summarise(rounds)
    print("| N | method | measured ms | predicted, prefetch | error | predicted, serial | error |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['n']} | {r['method']} | {r['measured_ms']:.1f} | {r['prefetch_ms']:.1f} | "
            f"{r['prefetch_error']:+.0%} | {r['serial_ms']:.1f} | {r['serial_error']:+.0%} |"
        )
    for mode in ("prefetch", "serial"):
        errs = sorted(abs(r[f"{mode}_error"]) for r in rows)
        print(f"{mode}: median |error| {statistics.median(errs):.0%}, worst {errs[-1]:.0%}")
    OUT.write_text(
        json.dumps(
            {
                "kind": "dplab.sharded_vs_sim",
                "command": COMMAND,
                "date": datetime.now(UTC).isoformat(timespec="seconds"),
                "machine": machine_info(),
                "rows": rows,
                "rounds": rounds,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
