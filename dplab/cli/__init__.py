"""``python -m dplab VERB``: the command line of the course, one module per verb.

Each verb module has ``add_cli(subparsers)``, which registers its parser and sets ``func``.
The list below is static, so ``python -m dplab --help`` shows every verb and an import error in
one verb is an error, not a silently missing verb. A new verb is a new module here plus one line
in :data:`VERBS`. This package is the top layer: it may import anything, nothing imports it.
"""

from __future__ import annotations

import argparse
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
    return int(args.func(args) or 0)
