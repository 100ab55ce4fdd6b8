"""``python -m dplab trace``: measure traced DDP steps and write them where tools can read them.

Writes ``rank{r}.json`` per rank, ``trace.json`` (Chrome trace events: open it in
https://ui.perfetto.dev or chrome://tracing) and ``timeline.html`` (a plotly timeline with
plotly.js embedded, so it opens offline). Under ``torchrun --nproc-per-node N -m dplab trace …``
every process traces its own rank and rank 0 writes the files for all.

Everything that can be checked is checked before a rank starts: the numbers (argparse types),
the world size against what this machine holds, and the output folder (empty, absent, or a
run to replace with ``--overwrite``; never someone else's files; creatable). The files are
written into a temporary folder that is renamed into place whole (:func:`save_run`).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from dplab.cli._args import (
    PAGE_BYTES,
    CliError,
    cap_mb,
    check_ranks,
    check_writable_folder,
    count,
    fail,
    positive_int,
    write_failed,
)


def check_trace_args(args: argparse.Namespace, world_size: int) -> Path:
    """Everything the run would otherwise find out after measuring; the output folder."""
    from dplab.ddp.names import VARIANT_NAMES
    from dplab.model_config import MODELS
    from dplab.trace.files import check_run_folder

    positive_int("--world-size", world_size)
    for flag in ("--bucket-cap-mb", "--first-bucket-cap-mb"):
        cap_mb(flag, getattr(args, _attr(flag)))
    for flag in ("--steps", "--batch-size"):
        positive_int(flag, getattr(args, _attr(flag)))
    count("--warmup", args.warmup)
    if args.model not in MODELS or args.variant not in VARIANT_NAMES:  # argparse's choices, in code
        raise CliError(f"--model {args.model!r} / --variant {args.variant!r}: unknown")

    if args.out == "":
        raise CliError("--out is empty: name a folder for the run, e.g. --out runs/NAME/")
    try:
        out = check_run_folder(args.out, overwrite=args.overwrite)
    except FileExistsError as e:
        raise CliError(f"--out: {str(e).replace('overwrite=True', '--overwrite')}") from None
    except (NotADirectoryError, ValueError) as e:
        raise CliError(f"--out {args.out!r}: {e}") from None
    # the timeline page embeds plotly.js; the rank files and trace.json are small beside it
    check_writable_folder(out.absolute().parent, what="--out", needs_bytes=PAGE_BYTES)
    check_ranks(world_size)
    return out


def _attr(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def cmd_trace(args: argparse.Namespace) -> int:
    from dplab.env import in_torchrun

    world_size = int(os.environ["WORLD_SIZE"]) if in_torchrun() else args.world_size
    try:
        check_trace_args(args, world_size)
    except CliError as e:
        return fail(str(e))
    return _trace(args, world_size)


def _trace(args: argparse.Namespace, world_size: int) -> int:
    import torch.distributed as dist

    import dplab
    from dplab.ddp import measure_ddp
    from dplab.env import machine_info
    from dplab.trace import last_steps
    from dplab.trace.files import save_run
    from dplab.viz.timeline import timeline_figure

    load_before = [round(x, 2) for x in os.getloadavg()]
    kwargs = {
        "bucket_cap_mb": args.bucket_cap_mb,
        "first_bucket_cap_mb": args.first_bucket_cap_mb,
        "variant": args.variant,
        "steps": args.steps,
        "warmup": args.warmup,
        "batch_size": args.batch_size,
    }
    results = dplab.launch(
        measure_ddp, world_size, backend=args.backend, args=(args.model,), kwargs=kwargs
    )
    if dist.is_initialized() and dist.get_rank() != 0:
        return 0
    steps = results
    command = "python -m dplab trace " + " ".join(args.argv)
    meta = {
        "command": command,
        "model": args.model,
        **kwargs,
        # A trace kept in assets/ or sent to a colleague must say where and when it was taken.
        "recorded": {
            "machine": machine_info(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": command,
            "load_average_before": load_before,
        },
    }
    fig = timeline_figure(
        last_steps(steps),
        title=f"{args.model}, {world_size} ranks, bucket cap {args.bucket_cap_mb} MiB",
    )
    html = fig.to_html(include_plotlyjs=True, full_html=True)
    # One rename puts the traces and the timeline in place together; a disk that filled during
    # the run fails before it, so a run already in --out is still whole.
    try:
        paths = save_run(
            steps, args.out, meta, overwrite=args.overwrite, extra_files={"timeline.html": html}
        )
    except OSError as e:
        return write_failed("--out", args.out, e)
    last = steps[0][-1].metrics
    print(
        f"{len(steps[0])} steps on {world_size} ranks ({steps[0][-1].backend}); "
        "the last step of rank 0: "
        f"step {last.t_step_ms:.1f} ms, compute {last.t_compute_ms:.1f} ms, "
        f"comm {last.t_comm_ms:.1f} ms, exposed {last.exposed_comm_ms:.1f} ms, "
        f"overlap {last.overlap_fraction:.0%}"
    )
    for name, path in paths.items():
        print(f"  {name}: {path}")
    return 0


def add_cli(sub: argparse._SubParsersAction) -> None:
    from dplab.ddp.names import VARIANT_NAMES
    from dplab.model_config import MODELS

    p = sub.add_parser("trace", help="measure traced DDP steps; write JSON, Chrome trace, HTML")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    p.add_argument("--model", default="tiny-gpt", choices=MODELS)
    p.add_argument("--variant", default="bucketed", choices=VARIANT_NAMES)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--first-bucket-cap-mb", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=8, help="per rank (B_local)")
    p.add_argument("--out", required=True, help="folder for the files, e.g. runs/NAME/")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run already in --out (a folder of someone else's files never is)",
    )
    p.set_defaults(func=cmd_trace)
