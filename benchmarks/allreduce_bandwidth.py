"""All-reduce time against size on gloo over loopback: dist.all_reduce, the send/recv ring, naive.

Measures 1 KiB..256 MiB on 2 and 4 gloo ranks (rounds alternate between the world sizes, and
within a size the three algorithms alternate, so a busy moment of the shared machine hits all
of them), fits α-β per (algorithm, world size), and writes

* ``assets/gloo_loopback_bandwidth.json``: machine, date, command, rows, fits, and ``link``
  (α, β, bandwidth of ``dist.all_reduce`` at N=2): the simulator's "this machine" link preset;
* the section "## All-reduce bandwidth (gloo, loopback)" of ``docs/benchmarks.md`` (only that
  section is rewritten; the rest of the file is kept).

Run it quiet and under the shared lock:

    flock /tmp/dplab-cpu.lock .venv/bin/python benchmarks/allreduce_bandwidth.py
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _stats import median_ratio

import dplab
from dplab._units import MIB, format_size
from dplab.collectives import (
    ALGORITHMS,
    BandwidthRow,
    algbw,
    bandwidth_bench,
    bandwidth_report,
    busbw,
    fit_rows,
    geometric_sizes,
)

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## All-reduce bandwidth (gloo, loopback)"


def merge_rounds(rounds: list[list[BandwidthRow]]) -> list[BandwidthRow]:
    """One row per (algorithm, N, size): the median over every repeat of every round."""
    pooled: dict[tuple[str, int, int], list[BandwidthRow]] = {}
    for rows in rounds:
        for r in rows:
            pooled.setdefault((r.algorithm, r.world_size, r.size_bytes), []).append(r)
    out = []
    for (a, n, s), rows in sorted(pooled.items()):
        repeats = [t for r in rows for t in r.repeats_s]
        t = statistics.median(repeats)
        out.append(
            BandwidthRow(
                a, n, s, t, algbw(s, t) / 1e9, busbw(s, t, n) / 1e9, rows[0].iters, repeats
            )
        )
    return out


def _us(t: float) -> str:
    return f"{t * 1e6:,.0f}" if t >= 1e-4 else f"{t * 1e6:.1f}"


def docs_section(report: dict) -> str:
    """The Markdown section, from the saved report alone (so it can be re-rendered)."""
    rows = [BandwidthRow(**r) for r in report["rows"]]
    ratios = report["ratios_at_largest_size"]
    small_ratios = report["ratios_at_smallest_size"]
    m = report["machine"]
    world_sizes = sorted({r.world_size for r in rows})
    algorithms = [a for a in ALGORITHMS if any(r.algorithm == a for r in rows)]
    by = {(r.algorithm, r.world_size, r.size_bytes): r for r in rows}
    head = ["size"]
    for n in world_sizes:
        head += [f"N={n} {a} (µs)" for a in algorithms] + [f"N={n} all_reduce busbw (GB/s)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "--:|" * len(head)]
    for s in sorted({r.size_bytes for r in rows}):
        cells = [format_size(s)]
        for n in world_sizes:
            cells += [_us(by[(a, n, s)].time_s) for a in algorithms]
            cells.append(f"{by[('all_reduce', n, s)].busbw_GBps:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    fits = [
        "| algorithm | N | α (µs) | 1/β (GB/s) | rel. error median | rel. error max |",
        "|---|--:|--:|--:|--:|--:|",
    ]
    for f in report["fits"]:
        bw = "∞" if f["bandwidth_GBps"] is None else f"{f['bandwidth_GBps']:.2f}"
        fits.append(
            f"| {f['algorithm']} | {f['world_size']} | {f['alpha_s'] * 1e6:,.0f} | {bw} | "
            f"{f['median_rel_error']:.0%} | {f['max_rel_error']:.0%} |"
        )
    link = report["link"]
    quick = next(
        f
        for f in report["fits_on_quickest_repeat"]
        if f["algorithm"] == "all_reduce" and f["world_size"] == link["world_size"]
    )
    crowded = [n for n in world_sizes if n > m["usable_cores"]]
    crowd_note = (
        f" With N={', '.join(map(str, crowded))} there are more ranks than cores: they take turns."
        if crowded
        else ""
    )
    smallest = format_size(min(r.size_bytes for r in rows))
    small_lines = [
        f"At {smallest}, where α dominates (naive: 2 rounds of messages; ring: 2(N-1)):",
        "",
    ]
    small_lines += [
        f"- {label}: **{p:.2f}×** (95% interval {lo:.2f}–{hi:.2f}): naive is "
        f"{'faster' if hi < 1 else 'slower' if lo > 1 else 'not clearly different'}"
        for label, (p, lo, hi) in small_ratios.items()
    ]
    ratio_lines = [
        f"- {label}: **{p:.2f}×** (95% bootstrap interval {lo:.2f}–{hi:.2f})"
        for label, (p, lo, hi) in ratios.items()
    ]
    return f"""{SECTION}

Time of one all-reduce of a float32 tensor against its size, on gloo ranks talking over the
loopback interface of one machine: `dist.all_reduce` (gloo's own algorithm), and
`dplab.collectives`' ring (reduce-scatter + all-gather from `isend`/`irecv`) and naive
(gather to rank 0 + broadcast). Each figure is the median over {report["rounds"]} rounds ×
{report["repeats"]} repeats of a timed batch (barrier, then enough back-to-back calls to last
10 ms, slowest rank); bandwidths as nccl-tests defines them (algbw = S/t,
busbw = algbw·2(N-1)/N).

    {report["command"]}

Machine: {m["usable_cores"]} cores ({m["cpu_model"]}), torch {m["torch"]}, {report["date"]};
load average {report["load_average_before"]} before, {report["load_average_after"]} after
(the ranks themselves load both cores; the 1-minute figure before still holds the tail of
earlier work). Small sizes are the noisiest.{crowd_note} Raw rows, every repeat and
the fits: `assets/gloo_loopback_bandwidth.json`.

{chr(10).join(lines)}

α-β fits (least squares on relative error; ring model 2(N-1)·α + 2(N-1)/N·S·β, naive model
2(N-1)·(α + S·β)):

{chr(10).join(fits)}

The simulator's "this machine, gloo loopback" link: α = {link["alpha_s"] * 1e6:,.0f} µs,
β = {link["beta_s_per_byte"]:.3e} s/B, i.e. {link["bandwidth_GBps"] or math.inf:.2f} GB/s
(`dist.all_reduce`, N = {link["world_size"]}). Fitted to the quickest repeat instead of the
median (nearer to a quiet machine): α = {quick["alpha_s"] * 1e6:,.0f} µs,
1/β = {quick["bandwidth_GBps"] or math.inf:.2f} GB/s.

Ratios of medians at {format_size(max(r.size_bytes for r in rows))} (over all repeats):

{chr(10).join(ratio_lines)}

{chr(10).join(small_lines)}

Loopback is not a network: every byte is copied by the two shared cores through the kernel's
TCP stack. So α here is software (Python, gloo, syscalls, waking a rank), and the "link" that β
measures is the CPUs and memory that all ranks share, not one wire per rank. The ring's
advantage is per link, so it need not show here: at N=2 ring and naive copy the same 2·S bytes
in total. The α-β shape (flat, then linear) still holds, which is what the simulator
borrows; the numbers are this machine's, not a GPU fabric's.
"""


def write_section(path: Path, section: str) -> None:
    """Replace (or append) this benchmark's section; leave every other section as it is."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    start = text.find(SECTION)
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        nxt = text.find("\n## ", start + len(SECTION))
        end = len(text) if nxt < 0 else nxt + 1
        text = text[:start] + section + ("\n" + text[end:] if nxt >= 0 else "")
    path.write_text(text.rstrip("\n") + "\n")


def add_comparisons(report: dict, rows: list[BandwidthRow]) -> None:
    """Ratios of medians (with bootstrap intervals) and fits on the quickest repeat."""
    sizes = sorted({r.size_bytes for r in rows})
    world_sizes = sorted({r.world_size for r in rows})
    by = {(r.algorithm, r.world_size, r.size_bytes): r.repeats_s for r in rows}
    large, small = {}, {}
    for n in world_sizes:
        ring, naive = by[("ring", n, sizes[-1])], by[("naive", n, sizes[-1])]
        large[f"ring / dist.all_reduce, N={n}"] = median_ratio(
            ring, by[("all_reduce", n, sizes[-1])]
        )
        large[f"naive / ring, N={n}"] = median_ratio(naive, ring)
        small[f"naive / ring, N={n}"] = median_ratio(
            by[("naive", n, sizes[0])], by[("ring", n, sizes[0])]
        )
    report["ratios_at_largest_size"] = {k: list(v) for k, v in large.items()}
    report["ratios_at_smallest_size"] = {k: list(v) for k, v in small.items()}
    quickest = [replace(r, time_s=min(r.repeats_s)) for r in rows]
    report["fits_on_quickest_repeat"] = [
        f.to_dict() | {"algorithm": a} for (a, _), f in sorted(fit_rows(quickest).items())
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--max-size-mb", type=float, default=256.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(ROOT / "assets" / "gloo_loopback_bandwidth.json"))
    p.add_argument("--docs", default=str(ROOT / "docs" / "benchmarks.md"))
    p.add_argument("--no-docs", action="store_true", help="do not touch docs/benchmarks.md")
    p.add_argument("--from-json", help="measure nothing: rewrite the docs section from this JSON")
    args = p.parse_args()
    if args.from_json:
        write_section(Path(args.docs), docs_section(json.loads(Path(args.from_json).read_text())))
        print(f"updated {args.docs} from {args.from_json}")
        return
    sizes = geometric_sizes(1024, int(args.max_size_mb * MIB), 4)
    command = "flock /tmp/dplab-cpu.lock .venv/bin/python benchmarks/allreduce_bandwidth.py"
    if sys.argv[1:]:
        command += " " + " ".join(sys.argv[1:])
    load_before = [round(x, 2) for x in os.getloadavg()]
    t0 = time.monotonic()
    rounds: list[list[BandwidthRow]] = []
    clusters = [dplab.Cluster(n, backend="gloo", timeout_s=1800) for n in args.world_sizes]
    try:
        for k in range(args.rounds):
            for c in clusters:
                print(f"round {k + 1}/{args.rounds}, N={c.world_size} ...", flush=True)
                rows = c.run(bandwidth_bench, sizes, algorithms=ALGORITHMS, repeats=args.repeats)[0]
                rounds.append(rows)
    finally:
        for c in clusters:
            c.close()
    rows = merge_rounds(rounds)
    report = bandwidth_report(rows, command=command, backend="gloo")
    report.update(
        rounds=args.rounds,
        repeats=args.repeats,
        load_average_before=load_before,
        load_average_after=[round(x, 2) for x in os.getloadavg()],
        wall_s=round(time.monotonic() - t0, 1),
    )
    add_comparisons(report, rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    section = docs_section(report)
    print(section)
    for (a, n), f in sorted(fit_rows(rows).items()):
        print(f"fit {a} N={n}: alpha {f.alpha_s * 1e6:.1f} us, {f.bandwidth_GBps:.3f} GB/s")
    print(f"wrote {args.out} in {report['wall_s']} s")
    if not args.no_docs:
        Path(args.docs).parent.mkdir(parents=True, exist_ok=True)
        write_section(Path(args.docs), section)
        print(f"updated {args.docs}")


if __name__ == "__main__":
    main()
