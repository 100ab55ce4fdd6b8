"""``python -m dplab profile``: measure a model's backward profile on real ranks, save it.

The output file is checked before the ranks start and written atomically (a temporary file
beside it, then a rename): an interrupted run leaves the old profile, never half a new one.
"""

from __future__ import annotations

import argparse
import json
import sys

from dplab._units import MIB
from dplab.cli._args import (
    JSON_BYTES,
    CliError,
    check_output_file,
    check_ranks,
    count,
    fail,
    positive_int,
    write_failed,
)
from dplab.model_config import MODELS
from dplab.sim import measure_profile
from dplab.trace.files import write_atomic


def cmd_profile(args: argparse.Namespace) -> int:
    """Measure a BackwardProfile on real ranks and save it as JSON."""
    try:
        positive_int("--world-size", args.world_size)
        for flag in ("--batch-size", "--steps"):
            positive_int(flag, getattr(args, flag[2:].replace("-", "_")))
        for flag in ("--warmup", "--contention-repeats"):
            count(flag, getattr(args, flag[2:].replace("-", "_")))
        check_output_file(args.out, what="--out", needs_bytes=JSON_BYTES)
        check_ranks(args.world_size)
    except CliError as e:
        return fail(str(e))
    command = " ".join(["python -m dplab profile", *getattr(args, "argv", sys.argv[2:])])
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
    try:
        write_atomic(args.out, json.dumps(profile.to_dict(), indent=1) + "\n")
    except OSError as e:
        return write_failed("--out", args.out, e)
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
    q.add_argument("--model", default="tiny-gpt", choices=MODELS)
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
