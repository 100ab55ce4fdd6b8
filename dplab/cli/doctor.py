"""``python -m dplab doctor TRACE_DIR``: your own torch DDP job, where its steps go, and a cap.

TRACE_DIR holds one torch.profiler trace per rank (``prof.export_chrome_trace(...)`` or
``torch.profiler.tensorboard_trace_handler``; ``.json`` or ``.json.gz``), recorded with
``schedule=`` (for the ``ProfilerStep#N`` marks) and ``record_shapes=True`` (for the bucket and
gradient sizes). It prints the per-step and per-bucket summary, the step budget per rank (data
wait, forward, backward, exposed communication, optimizer, other), each all-reduce's achieved
bandwidth, HTA's overlap share, a line starting ``verdict:`` that names the largest part of the
step, and the recommendation: a cap only when the exposed communication is that part (with its
predicted gain and uncertainty). It writes ``timeline.html`` beside the traces: the measured
last step of every rank and the step predicted at the recommended cap, with plotly.js embedded
so that it opens offline.

``python -m dplab doctor --flight-recorder DIR`` reads a hung job instead: DIR holds one
flight-recorder dump per rank, named ``<prefix><rank>`` (as torch writes them on NCCL with
``TORCH_NCCL_DUMP_ON_TIMEOUT=1``; the layout ``torchfrtrace`` reads). Its line starting
``behind:`` names the rank and the sequence number of the collective it never issued (or issued
differently); then what each rank was doing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from dplab.cli._args import CliError, cap_mb, check_output_file, display_path, fail


def _inputs(args: argparse.Namespace) -> tuple[Path, Any]:
    """The trace folder, the logging data and the timeline's path, checked before reading."""
    folder = Path(args.trace_dir)
    if args.trace_dir == "" or not folder.is_dir():
        what = "does not exist" if not folder.exists() else "is not a folder"
        raise CliError(
            f"TRACE_DIR {args.trace_dir!r} {what}: give the folder of torch.profiler traces"
        )
    if args.current_cap_mb is not None:
        cap_mb("--current-cap-mb", args.current_cap_mb)
    logging_data = None
    if args.ddp_logging_data is not None:
        path = Path(args.ddp_logging_data)
        try:
            logging_data = json.loads(path.read_text())
        except OSError as e:
            raise CliError(f"--ddp-logging-data {str(path)!r}: {e.strerror or e}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CliError(f"--ddp-logging-data {str(path)!r} is not JSON: {e}") from None
    out = Path(args.html) if args.html is not None else folder / "timeline.html"
    check_output_file(str(out), what="--html", inputs={"--ddp-logging-data": args.ddp_logging_data})
    return out, logging_data


def _flight_recorder(args: argparse.Namespace) -> int:
    """``--flight-recorder DIR``: every rank's dump read side by side; the rank that is behind."""
    from dplab.doctor.flight_recorder import read_flight_recorder

    try:
        report = read_flight_recorder(args.flight_recorder)
    except ValueError as e:
        return fail(str(e).strip().splitlines()[0])
    print(report.summary())
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    if args.flight_recorder is not None:
        return _flight_recorder(args)
    if args.trace_dir is None:
        return fail("give TRACE_DIR (torch.profiler traces) or --flight-recorder DIR (dumps)")
    from dplab.doctor import diagnose
    from dplab.trace.files import write_atomic
    from dplab.trace.profiler import from_profiler
    from dplab.viz.timeline import timeline_figure

    try:
        out, logging_data = _inputs(args)
        runs = from_profiler(args.trace_dir, ddp_logging_data=logging_data)
        d = diagnose(
            runs,
            link=args.link,
            prior=args.prior,
            current_cap_mb=args.current_cap_mb,
            ddp_logging_data=logging_data,
        )
    except (CliError, ValueError, FileNotFoundError) as e:
        return fail(str(e).strip().splitlines()[0] if str(e).strip() else repr(e))
    print(d.summary())
    panels = [[steps[-1] for steps in runs]]
    titles = [f"measured: step {runs[0][-1].step}, cap {d.current_cap_mb:.3g} MiB"]
    if d.simulated_best is not None and d.best_cap_mb != d.current_cap_mb:
        panels.append([d.simulated_best])
        titles.append(f"predicted at {d.best_cap_mb:.3g} MiB ({d.link.name})")
    title = "dplab doctor: " + display_path(args.trace_dir)  # a non-UTF-8 name: plotly refuses
    fig = timeline_figure(panels, panel_titles=titles, title=title)
    write_atomic(out, fig.to_html(include_plotlyjs=True, full_html=True))
    print(f"timeline: {out}")
    return 0


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        help="read a torch.profiler trace of your DDP job: step budget, verdict, a better cap",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("trace_dir", nargs="?", help="folder with one torch.profiler trace per rank")
    p.add_argument(
        "--flight-recorder",
        metavar="DIR",
        default=None,
        help="folder of flight-recorder dumps, one per rank named <prefix><rank>: which rank "
        "is behind, at which collective (the line starting 'behind:')",
    )
    p.add_argument(
        "--link", default=None, help="a dplab.sim link preset for the what-if (default: fitted)"
    )
    p.add_argument(
        "--prior",
        default=None,
        help="link preset whose α:β the fit keeps when all buckets are one size",
    )
    p.add_argument("--current-cap-mb", type=float, default=None, help="the job's bucket_cap_mb")
    p.add_argument(
        "--ddp-logging-data",
        default=None,
        help="JSON file of ddp._get_ddp_logging_data() (sizes when shapes were not recorded)",
    )
    p.add_argument("--html", default=None, help="where to write the timeline (default: beside)")
    p.set_defaults(func=cmd_doctor)


add_parser = add_cli  # the name the coordinator's brief used
