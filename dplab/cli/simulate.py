"""``python -m dplab simulate``: predict a DDP step from a saved profile and a link or fabric.

python -m dplab simulate --preset aws-p5 --nodes 16 --model gpt-7m
python -m dplab simulate --gpu h100 --gpus-per-node 8 --nodes 4 --nic-gbps 400 --model gpt-7m
python -m dplab simulate --profile my_profile.json --link gloo-loopback --world-size 4
python -m dplab simulate --preset dgx-h100 --nodes 4 --model gpt-7m --sharding zero3

``--json`` is checked before anything is computed (it may not be the ``--profile`` it reads)
and written atomically: a temporary file beside it, then a rename.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from dplab._units import MIB
from dplab.cli._args import CliError, cap_mb, check_output_file, fail, positive_float
from dplab.sim import (
    FABRIC_PRESETS,
    GPUS,
    LINK_NAMES,
    BackwardProfile,
    Fabric,
    best_bucket_cap,
    faster_compute,
    get_link,
    simulate,
)
from dplab.sim.fabric import NETWORKS
from dplab.sim.link import ASSETS
from dplab.sim.sharded import METHODS as SHARDED_METHODS
from dplab.sim.sharded import UnitProfile, simulate_sharded
from dplab.trace.files import write_atomic

__all__ = ["add_cli", "cmd_simulate", "fail", "format_metrics"]


def format_metrics(trace) -> str:
    m = trace.metrics
    rows = [
        ("t_step", m.t_step_ms, "ms"),
        ("t_compute (fwd + bwd + opt)", m.t_compute_ms, "ms"),
        ("t_comm (all-reduces)", m.t_comm_ms, "ms"),
        ("exposed comm", m.exposed_comm_ms, "ms"),
        ("max(T_compute, T_comm)", m.predicted_step_ms, "ms"),
        ("overlap fraction", m.overlap_fraction * 100, "%"),
    ]
    return "\n".join(f"  {name:<30}{value:>12,.2f} {unit}" for name, value, unit in rows)


HARDWARE = ("gpu", "gpus_per_node", "nics_per_node", "nic_gbps", "network")


def _fabric(args: argparse.Namespace) -> Fabric | None:
    """The fabric the options describe (a preset, or hardware), or None for a Link."""
    hw = {k: getattr(args, k) for k in HARDWARE if getattr(args, k) is not None}
    if args.preset is None and not hw:
        given = {
            "--nodes": args.nodes,
            "--net-latency-us": args.net_latency_us,
            "--nccl-tests-log": args.nccl_tests_log,
        }
        for flag, value in given.items():
            if value is not None:
                raise ValueError(f"{flag} needs a fabric: give --preset or --gpu")
        return None
    if args.link is not None or args.world_size is not None:
        raise ValueError(
            "--link/--world-size describe a flat ring; a fabric (--preset/--gpu) carries its "
            "own ranks: use --nodes and --gpus-per-node"
        )
    nodes = 1 if args.nodes is None else args.nodes
    if args.net_latency_us is not None:
        hw["net_latency_us"] = args.net_latency_us
    if args.preset is not None:
        fabric = Fabric.preset(args.preset, nodes=nodes, **hw)
    else:
        fabric = Fabric.from_hardware(**hw, nodes=nodes)
    if args.nccl_tests_log is not None:
        # fitted at the log's own node count, then carried to --nodes
        fabric = fabric.calibrated_from(_read_log(args.nccl_tests_log))
    return fabric


def _read_log(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except FileNotFoundError:
        raise FileNotFoundError(f"--nccl-tests-log: no file at {path}") from None
    except IsADirectoryError:
        raise ValueError(f"--nccl-tests-log {path!r} is a folder, not an nccl-tests log") from None


def _profile(args: argparse.Namespace) -> BackwardProfile:
    if (args.profile is None) == (args.model is None):
        raise ValueError("give one of --profile PATH or --model NAME")
    path = Path(args.profile) if args.profile else ASSETS / f"profile_{args.model}.json"
    try:
        profile = BackwardProfile.load(path)
    except FileNotFoundError:
        hint = f"python -m dplab profile --model {args.model or 'NAME'} --out {path}"
        raise FileNotFoundError(f"no profile at {path} (make one with `{hint}`)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: {e}") from None
    if args.compute_speedup != 1:
        profile = faster_compute(profile, args.compute_speedup)
    return profile


def cmd_simulate(args: argparse.Namespace) -> int:
    """Predict one step's metrics and the best bucket cap from a saved profile."""
    try:
        cap_mb("--bucket-cap-mb", args.bucket_cap_mb)
        cap_mb("--first-bucket-cap-mb", args.first_bucket_cap_mb)
        positive_float("--compute-speedup", args.compute_speedup)
        if args.json is not None:
            check_output_file(args.json, what="--json", inputs={"--profile": args.profile})
        profile = _profile(args)
        fabric = _fabric(args)
        if fabric is None:
            net = {
                "link": get_link(args.link or "ib-400g"),
                "world_size": 2 if args.world_size is None else args.world_size,
            }
        else:
            net = {"fabric": fabric}
        if args.sharding is not None:
            if args.contention or args.json is not None:
                raise ValueError("--sharding predicts spans of its own: no --contention, no --json")
            return _sharded(args, profile, fabric, net)
        contention = None
        if args.contention:
            if profile.contention is None:
                return fail(f"{args.profile or args.model} has no measured contention")
            contention = profile.contention
        trace = simulate(
            profile,
            bucket_cap_mb=args.bucket_cap_mb,
            first_bucket_cap_mb=args.first_bucket_cap_mb,
            contention=contention,
            **net,
        )
        best = best_bucket_cap(
            profile,
            first_bucket_cap_mb=args.first_bucket_cap_mb,
            contention=contention,
            **net,
        )
        at_best = simulate(
            profile,
            bucket_cap_mb=best,
            first_bucket_cap_mb=args.first_bucket_cap_mb,
            contention=contention,
            **net,
        )
    except (CliError, ValueError, FileNotFoundError) as e:
        return fail(str(e))
    n_buckets = len(trace.buckets)
    where = fabric if fabric is not None else net["link"]
    print(
        f"simulated {profile.model} on {where.describe()}\n"
        f"{trace.world_size:,} ranks, bucket cap {args.bucket_cap_mb:g} MiB "
        f"(first {args.first_bucket_cap_mb:g} MiB): {n_buckets} bucket"
        f"{'s' if n_buckets != 1 else ''}, "
        f"{profile.total_bytes / MIB:,.1f} MiB of gradients"
        + (", with measured contention" if contention else "")
    )
    print(format_metrics(trace))
    if fabric is not None:
        picks = Counter("/".join(fabric.choice(b.nbytes)) for b in trace.buckets)
        print(
            "  NCCL algorithm/protocol per bucket (model): "
            + ", ".join(f"{k} × {v}" for k, v in picks.most_common())
        )
    gain = 1 - at_best.metrics.t_step_ms / trace.metrics.t_step_ms
    print(
        f"best bucket cap: {best:g} MiB -> t_step {at_best.metrics.t_step_ms:,.2f} ms "
        f"({gain:.1%} less than at {args.bucket_cap_mb:g} MiB)"
    )
    if args.json is not None:
        doc = {"trace": trace.to_dict(), "best_bucket_cap_mb": best}
        write_atomic(args.json, json.dumps(doc, indent=1))
        print(f"wrote {args.json}")
    return 0


def _sharded(
    args: argparse.Namespace, profile: BackwardProfile, fabric: Fabric | None, net: dict
) -> int:
    """The sharded step and DDP's, simulated side by side on the same units and network."""
    units = UnitProfile.from_backward(profile)
    where = fabric if fabric is not None else net["link"]
    n = fabric.world_size if fabric is not None else net["world_size"]
    # gloo has no reduce-scatter of its own: on a gloo link it costs a whole all-reduce
    backend = "gloo" if fabric is None and net["link"].name.startswith("gloo") else "nccl"
    runs = {m: simulate_sharded(units, m, where, n, backend=backend,
                                bucket_cap_mb=args.bucket_cap_mb)
            for m in dict.fromkeys(("ddp", args.sharding))}  # fmt: skip
    print(
        f"simulated {profile.model} on {where.describe()}\n{n:,} ranks; "
        f"{len(units.block_bytes)} blocks as FSDP units, {units.param_bytes / MIB:,.1f} MiB of "
        "weights; backward per unit from the profile, forward split in the same proportions; "
        f"{backend}'s collectives"
    )
    for method, pred in runs.items():
        print(
            f"  {method:<6} step {pred.step_ms:10,.2f} ms   compute {pred.compute_ms:10,.2f} ms   "
            f"collectives {pred.comm_ms:10,.2f} ms   exposed {pred.exposed_comm_ms:10,.2f} ms"
        )
    extra = runs[args.sharding].step_ms / runs["ddp"].step_ms - 1
    print(f"{args.sharding} against DDP: {extra:+.1%} step time")
    return 0


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="predict a DDP step from a profile and a link or fabric")
    p.add_argument("--profile", help="a profile JSON (python -m dplab profile)")
    p.add_argument("--model", help="use the saved profile assets/profile_MODEL.json")
    p.add_argument(
        "--compute-speedup",
        type=float,
        default=1.0,
        help="divide the profile's compute times by this (a what-if: a GPU is faster than the "
        "CPU the profile was measured on)",
    )
    g = p.add_argument_group("a flat ring (dplab.sim.Link)")
    g.add_argument("--link", choices=list(LINK_NAMES), help="default ib-400g")
    g.add_argument("--world-size", type=int, help="default 2")
    f = p.add_argument_group("a GPU cluster (dplab.sim.Fabric, NCCL's cost model)")
    f.add_argument("--preset", choices=list(FABRIC_PRESETS))
    f.add_argument("--nodes", type=int)
    f.add_argument("--gpu", choices=list(GPUS))
    f.add_argument("--gpus-per-node", type=int)
    f.add_argument("--nics-per-node", type=int)
    f.add_argument("--nic-gbps", type=float, help="one NIC's line rate, Gb/s")
    f.add_argument("--network", choices=list(NETWORKS))
    f.add_argument(
        "--net-latency-us",
        type=float,
        help="the network's cost per inter-node hop, µs (no public source gives it for every "
        "network; default: fitted to published runs on that network)",
    )
    f.add_argument(
        "--nccl-tests-log",
        metavar="FILE",
        help="your cluster's all_reduce_perf output: the fabric's bandwidth, latency and "
        "pipeline fill are fitted to it (at the log's node count) before simulating",
    )
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="MiB")
    p.add_argument("--first-bucket-cap-mb", type=float, default=1.0, help="MiB")
    p.add_argument(
        "--contention",
        action="store_true",
        help="apply the profile's measured compute/comm contention (a CPU box's shared cores)",
    )
    p.add_argument(
        "--sharding",
        choices=list(SHARDED_METHODS),
        help="predict a sharded step instead (§9b): one FSDP unit per block, its all-gathers and "
        "reduce-scatters prefetched as FSDP2 does on a GPU; DDP's step beside it",
    )
    p.add_argument("--json", help="also save the predicted StepTrace here")
    p.set_defaults(func=cmd_simulate)
