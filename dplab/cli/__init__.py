"""``python -m dplab VERB``: the command line of the course, one module per verb.

Each verb module has ``add_cli(subparsers)``, which registers its parser and sets ``func``.
The list below is static, so ``python -m dplab --help`` shows every verb and an import error in
one verb is an error, not a silently missing verb. A new verb is a new module here plus one line
in :data:`VERBS`. This package is the top layer: it may import anything, nothing imports it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import signal
import sys
from collections.abc import Sequence
from types import ModuleType

from dplab.cli import bandwidth, check, cluster, doctor, html, memory, profile, simulate, trace

__all__ = ["VERBS", "main"]

VERBS: tuple[ModuleType, ...] = (
    check,
    memory,
    bandwidth,
    trace,
    simulate,
    profile,
    doctor,
    html,
    cluster,
)
DESCRIPTION = "dplab: the command line of the course (python -m dplab VERB --help for a verb)."


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dplab", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="verb", required=True)
    for verb in VERBS:
        verb.add_cli(sub)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[2:] if argv is None else argv[1:])
    _print_any_file_name()
    try:
        status = int(args.func(args) or 0)
        sys.stdout.flush()  # inside the try: a closed pipe may only show at this flush
    except BrokenPipeError:
        return _reader_went_away()
    return status


def _print_any_file_name() -> None:
    """Let stdout and stderr print a file name that is not UTF-8 (kept by Python as lone
    surrogates) as its own bytes, as ``ls`` does, instead of failing after the work is done;
    Python does this by itself only under the C locale."""
    for stream in (sys.stdout, sys.stderr):
        # only the process's own streams: a caller's capture (pytest, a notebook) is its own
        if stream in (sys.__stdout__, sys.__stderr__) and isinstance(stream, io.TextIOWrapper):
            with contextlib.suppress(ValueError, io.UnsupportedOperation):
                stream.reconfigure(errors="surrogateescape")


def _reader_went_away() -> int:
    """``python -m dplab simulate … | head -1``: the reader has closed the pipe. Stop quietly,
    as Unix tools do (killed by SIGPIPE: status 128 + 13), with no traceback and no second
    error when the interpreter flushes stdout at exit: stdout is pointed at /dev/null."""
    with contextlib.suppress(OSError, ValueError, io.UnsupportedOperation):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return 128 + signal.SIGPIPE
