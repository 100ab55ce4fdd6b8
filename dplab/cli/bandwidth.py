"""``python -m dplab bandwidth``: all-reduce time against size on N ranks, with an α-β fit.

``--out`` and ``--html`` are checked before the ranks start and written atomically (a temporary
file beside each, then a rename).
"""

from __future__ import annotations

import argparse
import json
import sys

from dplab._units import KIB, MIB, format_size
from dplab.cli._args import (
    JSON_BYTES,
    PAGE_BYTES,
    CliError,
    check_output_file,
    check_ranks,
    fail,
    launched_world_size,
    positive_float,
    positive_int,
    world_size,
    write_failed,
)
from dplab.collectives import (
    ALGORITHMS,
    bandwidth_report,
    fit_rows,
    format_fit,
    format_table,
    geometric_sizes,
    measure_bandwidth,
)
from dplab.trace.files import write_atomic


def cmd_bandwidth(args: argparse.Namespace) -> int:
    """Measure all-reduce time against size, fit α-β, print; optionally save JSON and a plot."""
    n = launched_world_size(args.world_size)  # under torchrun (cluster -- bandwidth): its ranks
    if args.max_size_mb <= 0 or args.min_size_kb <= 0:
        return fail(
            f"sizes must be > 0, got --min-size-kb {args.min_size_kb} "
            f"--max-size-mb {args.max_size_mb}"
        )
    try:
        world_size("--world-size", n, minimum=2)
        positive_float("--min-size-kb", args.min_size_kb)  # also refuses nan and inf
        positive_float("--max-size-mb", args.max_size_mb)
        positive_int("--repeats", args.repeats)
        check_ranks(n)
        sizes = geometric_sizes(
            int(args.min_size_kb * KIB), int(args.max_size_mb * MIB), args.factor
        )
        if args.out is not None:
            check_output_file(args.out, what="--out", needs_bytes=JSON_BYTES)
        if args.html is not None:
            check_output_file(
                args.html, what="--html", inputs={"--out": args.out}, needs_bytes=PAGE_BYTES
            )
    except (CliError, ValueError) as e:
        return fail(str(e))
    print(
        f"all-reduce bandwidth on {n} ranks ({args.backend}), "
        f"{len(sizes)} sizes {format_size(sizes[0])}..{format_size(sizes[-1])}, "
        f"{args.repeats} repeats ...",
        flush=True,
    )
    rows = measure_bandwidth(
        n,
        sizes=sizes,
        algorithms=args.algorithms,
        repeats=args.repeats,
        backend=args.backend,
    )
    if _other_torchrun_rank():
        return 0  # under torchrun rank 0 prints and writes for all, as trace does
    print(format_table(rows))
    fits = fit_rows(rows)
    for (a, _), f in sorted(fits.items()):
        print(format_fit(a, f))
    command = " ".join(["python -m dplab bandwidth", *getattr(args, "argv", sys.argv[2:])])
    if args.out:
        from dplab.env import resolve_backend

        backend = resolve_backend(args.backend, n)
        report = bandwidth_report(rows, command=command, backend=backend)
        try:
            write_atomic(args.out, json.dumps(report, indent=1))
        except OSError as e:  # the table above is printed: the measurement is not lost
            return write_failed("--out", args.out, e)
        print(f"wrote {args.out}")
    if args.html:
        from dplab.viz.collectives import bandwidth_figure

        fig = bandwidth_figure(rows, fits)
        try:
            write_atomic(args.html, fig.to_html(include_plotlyjs=True, full_html=True))
        except OSError as e:
            return write_failed("--html", args.html, e)
        print(f"wrote {args.html}")
    return 0


def _other_torchrun_rank() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_rank() != 0


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bandwidth", help="all-reduce time vs size on N ranks, with an α-β fit")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    p.add_argument("--min-size-kb", type=float, default=1.0, help="smallest size, KiB")
    p.add_argument("--max-size-mb", type=float, default=256.0, help="largest size, MiB")
    p.add_argument("--factor", type=int, default=4, help="each size is FACTOR times the last")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--algorithms",
        nargs="+",
        default=["all_reduce"],
        choices=list(ALGORITHMS),
        help="all_reduce (torch.distributed), ring and naive (this module, from send/recv)",
    )
    p.add_argument("--out", help="save rows, fits and machine as JSON here")
    p.add_argument("--html", help="save the plot as a self-contained HTML file here")
    p.set_defaults(func=cmd_bandwidth)
