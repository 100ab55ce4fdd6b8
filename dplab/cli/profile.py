"""``python -m dplab profile``: measure a model's backward profile on real ranks, save it."""

from __future__ import annotations

import argparse
import sys

from dplab._units import MIB
from dplab.cli.simulate import fail
from dplab.sim import measure_profile


def cmd_profile(args: argparse.Namespace) -> int:
    """Measure a BackwardProfile on real ranks and save it as JSON."""
    command = "python -m dplab " + " ".join(sys.argv[1:]) if sys.argv[1:] else "python -m dplab"
    print(
        f"profiling {args.model} on {args.world_size} ranks: {args.steps} timed steps "
        f"after {args.warmup} warm-up ...",
        flush=True,
    )
    try:
        profile = measure_profile(
            args.model,
            world_size=args.world_size,
            batch_size=args.batch_size,
            steps=args.steps,
            warmup=args.warmup,
            contention_repeats=args.contention_repeats,
            command=command,
        )
    except ValueError as e:
        return fail(str(e))
    profile.save(args.out)
    print(
        f"{len(profile.params)} parameters, {profile.total_bytes / MIB:,.2f} MiB of gradients; "
        f"forward {profile.forward_ms:,.1f} ms, backward {profile.backward_ms:,.1f} ms, "
        f"optimizer {profile.optimizer_ms:,.1f} ms"
    )
    if profile.contention:
        c = profile.contention
        print(
            f"contention: while an all-reduce runs beside it, backward runs at "
            f"1/{1 + c.compute_slowdown:.2f} of its speed; the all-reduce pays "
            f"{c.alpha_factor:.1f}x α and {c.beta_factor:.1f}x β"
        )
    print(f"wrote {args.out}")
    return 0


def add_cli(sub: argparse._SubParsersAction) -> None:
    q = sub.add_parser("profile", help="measure a model's backward profile on real ranks")
    q.add_argument("--model", default="tiny-gpt")
    q.add_argument("--out", required=True, help="where to write the profile JSON")
    q.add_argument("--world-size", type=int, default=2)
    q.add_argument("--batch-size", type=int, default=8)
    q.add_argument("--steps", type=int, default=8)
    q.add_argument("--warmup", type=int, default=2)
    q.add_argument(
        "--contention-repeats",
        type=int,
        default=5,
        help="repeats of the contention probe (0: skip it)",
    )
    q.set_defaults(func=cmd_profile)
