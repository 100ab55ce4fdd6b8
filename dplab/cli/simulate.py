"""``python -m dplab simulate``: predict a DDP step from a saved profile and a link."""

from __future__ import annotations

import argparse
import json
import sys

from dplab._units import MIB
from dplab.sim import LINK_NAMES, BackwardProfile, best_bucket_cap, get_link, simulate


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


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


def cmd_simulate(args: argparse.Namespace) -> int:
    """Predict one step's metrics and the best bucket cap from a saved profile."""
    try:
        profile = BackwardProfile.load(args.profile)
    except FileNotFoundError:
        return fail(f"no profile at {args.profile} (make one with `python -m dplab profile`)")
    except (ValueError, json.JSONDecodeError) as e:
        return fail(f"{args.profile}: {e}")
    try:
        link = get_link(args.link)
        contention = None
        if args.contention:
            if profile.contention is None:
                return fail(f"{args.profile} has no measured contention")
            contention = profile.contention
        trace = simulate(
            profile,
            bucket_cap_mb=args.bucket_cap_mb,
            first_bucket_cap_mb=args.first_bucket_cap_mb,
            world_size=args.world_size,
            link=link,
            contention=contention,
        )
        best = best_bucket_cap(
            profile,
            world_size=args.world_size,
            link=link,
            first_bucket_cap_mb=args.first_bucket_cap_mb,
            contention=contention,
        )
        at_best = simulate(
            profile,
            bucket_cap_mb=best,
            first_bucket_cap_mb=args.first_bucket_cap_mb,
            world_size=args.world_size,
            link=link,
            contention=contention,
        )
    except (ValueError, FileNotFoundError) as e:
        return fail(str(e))
    n_buckets = len(trace.buckets)
    print(
        f"simulated {profile.model} on {link.describe()}\n"
        f"{args.world_size:,} ranks, bucket cap {args.bucket_cap_mb:g} MiB "
        f"(first {args.first_bucket_cap_mb:g} MiB): {n_buckets} bucket"
        f"{'s' if n_buckets != 1 else ''}, "
        f"{profile.total_bytes / MIB:,.1f} MiB of gradients"
        + (", with measured contention" if contention else "")
    )
    print(format_metrics(trace))
    gain = 1 - at_best.metrics.t_step_ms / trace.metrics.t_step_ms
    print(
        f"best bucket cap: {best:g} MiB -> t_step {at_best.metrics.t_step_ms:,.2f} ms "
        f"({gain:.1%} less than at {args.bucket_cap_mb:g} MiB)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"trace": trace.to_dict(), "best_bucket_cap_mb": best}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="predict a DDP step from a profile and a link")
    p.add_argument("--profile", required=True, help="a profile JSON (python -m dplab profile)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--link", default="ib-400g", choices=list(LINK_NAMES))
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="MiB")
    p.add_argument("--first-bucket-cap-mb", type=float, default=1.0, help="MiB")
    p.add_argument(
        "--contention",
        action="store_true",
        help="apply the profile's measured compute/comm contention (a CPU box's shared cores)",
    )
    p.add_argument("--json", help="also save the predicted StepTrace here")
    p.set_defaults(func=cmd_simulate)
