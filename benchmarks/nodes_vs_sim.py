"""The simulator against real multi-node DDP steps: gpt-7m on namespace nodes with shaped links.

Topologies 2 × 1, 2 × 2 and 4 × 1 ranks (nodes × ranks per node), each node's link shaped with
``tc tbf`` to 200, 400 and 1000 Mbit/s, gloo over the nodes' interfaces (``dplab.nodes``).

1. Calibrate the fabric once, with the bandwidth bench (all-reduces of 1 … 16 MiB,
   slowest rank per repeat, medians) and :func:`dplab.collectives.fit_alpha_beta`:
   the node link at each speed on 2 nodes × 1 rank (inter-node α, β), and the loopback of one
   node with 2 ranks (intra-node α, β). These two levels make a
   :meth:`dplab.sim.fabric.Fabric.from_levels` for every topology: the DDP cases below are
   predicted from it, not fitted to them.
2. For each topology and speed, one torchrun launch on every node runs a compute profile
   (:func:`dplab.sim.profile_rank`: per-gradient ready times with no communication, the same
   ranks on the same cores) and then traced DDP steps (:func:`dplab.ddp.measure_ddp`, bucket
   caps 25 MiB and 2 MiB, first bucket 1 MiB). Rounds rotate the order of the cases.
3. Predict each case with :func:`dplab.sim.simulate` from that run's profile and the fabric's
   ring time, with overlap for free, and compare medians of the step time (every timed step of
   every rank). Overlap for free, because here the shaped link, not the CPU, is what the bytes
   wait for: a gloo thread sleeping on a full socket costs the cores little. (The contention
   probe does not fit a shaped link: its quiet α is ~0, so the busy/quiet α factor blows up.)

Writes ``assets/nodes_vs_sim_gpt-7m.json`` (calibration, cases, machine, date, command) and
prints the table. Needs root (network namespaces); about 10 minutes on 2 idle cores.

    .venv/bin/python benchmarks/nodes_vs_sim.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
KIB, MIB = 1024, 1024 * 1024
# From 1 MiB up: tbf lets a 256 KiB burst through at full speed, which smaller sizes would see.
SIZES = [MIB, 2 * MIB, 4 * MIB, 8 * MIB, 16 * MIB]
SPEEDS = (200.0, 400.0, 1000.0)
TOPOLOGIES = ((2, 1), (2, 2), (4, 1))
CAPS = (25.0, 2.0)


# -- rank functions (shipped by value to every torchrun rank) ---------------------------------


def bench_allreduce(sizes: list[int], repeats: int) -> list[list[float]]:
    """Seconds of each all-reduce, per size and repeat, as the slowest rank saw it."""
    import torch
    import torch.distributed as dist

    out = []
    for size in sizes:
        x = torch.ones(size // 4)
        dist.all_reduce(x)  # warm-up: connections, buffers
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            times.append(dt.item())
        out.append(times)
    return out


def ddp_case(model: str, caps: list[float], steps: int) -> dict[str, Any]:
    """This rank's compute profile, then traced DDP steps at each cap."""
    from dplab.ddp import measure_ddp
    from dplab.sim import profile_rank

    profile = profile_rank(model, steps=4, warmup=1, contention_repeats=0)
    ddp = {cap: measure_ddp(model, bucket_cap_mb=cap, steps=steps, warmup=1) for cap in caps}
    return {"profile": profile, "ddp": ddp}


# -- calibration --------------------------------------------------------------------------------


def fit_levels(cluster: Any, repeats: int) -> dict[str, float]:
    """α and β of whatever ``cluster``'s ranks all-reduce over, by the ring model."""
    from dplab.collectives import fit_alpha_beta

    times = cluster.run(bench_allreduce, SIZES, repeats)[0]
    medians = [statistics.median(t) for t in times]
    fit = fit_alpha_beta(SIZES, medians, cluster.world_size)
    return {
        "alpha_s": fit.alpha_s,
        "beta_s_per_byte": fit.beta_s_per_byte,
        "bandwidth_MBps": 1e-6 / fit.beta_s_per_byte,
        "max_rel_error": fit.max_rel_error,
        "sizes": SIZES,
        "median_s": medians,
    }


def fabric_link(fabric: Any, name: str) -> Any:
    """The :class:`dplab.sim.Link` whose ring time is ``fabric``'s two-level ring time.

    ``simulate`` takes a Link; a two-level ring of N ranks is a flat ring whose per-step
    latency is the fabric's mean and whose β is its slowest level's, which this checks.
    """
    from dplab.sim import Link

    n = fabric.world_size
    lat = fabric.allreduce_s(0.0 + 1e-9, algorithm="ring")  # ~ latency alone
    t16 = fabric.allreduce_s(16 * MIB, algorithm="ring")
    beta = (t16 - lat) / (2 * (n - 1) / n * 16 * MIB)
    link = Link.from_beta(name, lat / (2 * (n - 1)), beta, fabric.describe())
    for size in (64 * KIB, 4 * MIB, 28 * MIB):
        want, got = fabric.allreduce_s(size, algorithm="ring"), link.allreduce_s(size, n)
        assert abs(got - want) <= 1e-9 + 1e-6 * want, (size, got, want)
    return link


# -- the cases ----------------------------------------------------------------------------------


def predict(profile: Any, link: Any, cap: float, n: int) -> Any:
    from dplab.sim import simulate

    return simulate(
        profile,
        bucket_cap_mb=cap,
        first_bucket_cap_mb=1.0,
        world_size=n,
        link=link,
    ).metrics


def main(argv: list[str] | None = None) -> int:
    from dplab.env import machine_info
    from dplab.nodes import Nodes, nodes_available
    from dplab.sim import profile_from_ranks
    from dplab.sim.fabric import Fabric
    from dplab.trace import StepTrace

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt-7m")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="bandwidth bench repeats per size")
    p.add_argument("--speeds", type=float, nargs="+", default=list(SPEEDS), help="Mbit/s")
    p.add_argument("--topologies", nargs="+", default=[f"{k}x{m}" for k, m in TOPOLOGIES])
    p.add_argument("--caps", type=float, nargs="+", default=list(CAPS), help="MiB")
    p.add_argument("--out", default=str(ROOT / "assets" / "nodes_vs_sim_gpt-7m.json"))
    args = p.parse_args(argv)
    speeds = tuple(args.speeds)
    topologies = [tuple(int(x) for x in t.split("x")) for t in args.topologies]
    caps = tuple(args.caps)
    ok, why = nodes_available()
    if not ok:
        print(f"skipped: {why}", file=sys.stderr)
        return 1
    t_start = time.time()
    load_before = list(__import__("os").getloadavg())

    print("calibrating: the node link at each speed (2 × 1), the loopback (1 × 2)", flush=True)
    inter: dict[float, dict[str, float]] = {}
    with Nodes(2, 1) as two:
        for mbit in speeds:
            two.set_link(mbit)
            inter[mbit] = fit_levels(two, args.repeats)
            f = inter[mbit]
            print(
                f"  {mbit:g} Mbit/s: α {f['alpha_s'] * 1e3:.2f} ms, "
                f"{f['bandwidth_MBps']:.1f} MB/s (line {mbit / 8:.1f}), fit error "
                f"{f['max_rel_error']:.1%}; medians "
                + ", ".join(f"{t * 1e3:.1f}" for t in f["median_s"])
                + " ms",
                flush=True,
            )
    with Nodes(1, 2) as one:
        intra = fit_levels(one, args.repeats)
    print(
        f"  loopback: α {intra['alpha_s'] * 1e3:.3f} ms, {intra['bandwidth_MBps']:.0f} MB/s",
        flush=True,
    )

    cases = [(k, m, s) for k, m in topologies for s in speeds]
    raw: dict[tuple[int, int, float], list[dict[str, Any]]] = {c: [] for c in cases}
    for r in range(args.rounds):
        by_topology: dict[tuple[int, int], list[float]] = {}
        for k, m, s in cases[r % len(cases) :] + cases[: r % len(cases)]:
            by_topology.setdefault((k, m), []).append(s)
        for (k, m), speeds in by_topology.items():
            with Nodes(k, m) as cluster:
                for mbit in speeds:
                    cluster.set_link(mbit)
                    t0 = time.time()
                    out = cluster.run(ddp_case, args.model, list(caps), args.steps)
                    raw[(k, m, mbit)].append({"ranks": out, "placement": cluster.placement})
                    print(f"  {k} × {m} at {mbit:g} Mbit/s: {time.time() - t0:.0f} s", flush=True)

    rows = []
    for k, m, mbit in cases:
        n = k * m
        fabric = Fabric.from_levels(
            gpus_per_node=m,
            nodes=k,
            intra_alpha_s=intra["alpha_s"],
            intra_beta_s_per_byte=intra["beta_s_per_byte"],
            inter_alpha_s=inter[mbit]["alpha_s"],
            inter_beta_s_per_byte=inter[mbit]["beta_s_per_byte"],
            name=f"{k} nodes × {m}, {mbit:g} Mbit/s",
        )
        link = fabric_link(fabric, fabric.name)
        for cap in caps:
            predicted, measured, exposed, comm, compute = [], [], [], [], []
            pred_comm, pred_compute = [], []
            for run in raw[(k, m, mbit)]:
                ranks = run["ranks"]
                profile = profile_from_ranks(args.model, [r["profile"] for r in ranks])
                sim = predict(profile, link, cap, n)
                predicted.append(sim.t_step_ms)
                pred_comm.append(sim.t_comm_ms)
                pred_compute.append(sim.t_compute_ms)
                for r in ranks:
                    for d in r["ddp"][cap]:
                        step = StepTrace.from_dict(d) if isinstance(d, dict) else d
                        met = step.metrics
                        measured.append(met.t_step_ms)
                        exposed.append(met.exposed_comm_ms)
                        comm.append(met.t_comm_ms)
                        compute.append(met.t_compute_ms)
            row = {
                "nodes": k,
                "ranks_per_node": m,
                "link_mbit": mbit,
                "bucket_cap_mb": cap,
                "measured_step_ms": statistics.median(measured),
                "measured_exposed_ms": statistics.median(exposed),
                "measured_comm_ms": statistics.median(comm),
                "measured_compute_ms": statistics.median(compute),
                "predicted_step_ms": statistics.median(predicted),
                "predicted_comm_ms": statistics.median(pred_comm),
                "predicted_compute_ms": statistics.median(pred_compute),
                "samples": len(measured),
            }
            row["error"] = row["predicted_step_ms"] / row["measured_step_ms"] - 1
            rows.append(row)

    print()
    print(
        "nodes × ranks  link Mbit/s  cap MiB  measured ms  predicted ms  error  exposed ms"
        "  compute meas./pred.  comm meas./pred."
    )
    for r in rows:
        print(
            f"{r['nodes']} × {r['ranks_per_node']:<10} {r['link_mbit']:>6g} "
            f"{r['bucket_cap_mb']:>9g} {r['measured_step_ms']:>12.0f} "
            f"{r['predicted_step_ms']:>13.0f} {r['error']:>+6.1%} {r['measured_exposed_ms']:>10.0f}"
            f"  {r['measured_compute_ms']:>8.0f} / {r['predicted_compute_ms']:<8.0f}"
            f"  {r['measured_comm_ms']:>6.0f} / {r['predicted_comm_ms']:.0f}"
        )
    errs = [abs(r["error"]) for r in rows]
    summary = {"median_abs_error": statistics.median(errs), "max_abs_error": max(errs)}
    print(
        f"median |error| {summary['median_abs_error']:.1%}, max {summary['max_abs_error']:.1%} "
        "(goal: median within 15%, every case within 25%)"
    )
    report = {
        "model": args.model,
        "command": "python benchmarks/nodes_vs_sim.py " + " ".join(argv or sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(),
        "load_average_before": load_before,
        "load_average_after": list(__import__("os").getloadavg()),
        "wall_s": round(time.time() - t_start, 1),
        "inter": {str(k): v for k, v in inter.items()},
        "intra": intra,
        "rows": rows,
        "summary": summary,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
