"""torch's own reader of flight-recorder dumps, ``torchfrtrace``, on the same folder.

``torchfrtrace`` (``torch.distributed.flight_recorder`` in the wheel) is the tool to use on NCCL
dumps. On gloo dumps of torch 2.13 it stops with a ``KeyError``: each entry names its group
(``process_group[0]``, e.g. ``'0'``) but ``pg_config`` holds one entry keyed ``''`` with no ranks,
and torchfrtrace looks the group up there (``build_groups_memberships``, then
``_pg_guids[(pg_name, rank)]`` in ``build_collectives``). :func:`fixed_up_copy` writes a copy
whose ``pg_config`` lists each group with its members, which is what an NCCL dump carries; the
entries are untouched. :func:`torchfrtrace_verdicts` runs torchfrtrace's matcher on a folder and
returns what it found, so that dplab's reading can be checked against a reader nobody here wrote.
"""

from __future__ import annotations

import logging
import os
import pickle
from pathlib import Path
from typing import NamedTuple

from dplab.doctor.flight_recorder import dump_files, read_dumps


class Verdict(NamedTuple):
    """One collective torchfrtrace could not match: its number, group, and the ranks it names
    (those missing from it, or the culprits of a mismatch)."""

    seq: int
    group: str
    ranks: tuple[int, ...]
    kind: str  # "missing" or the name of torchfrtrace's MatchState


def fixed_up_copy(
    src: str | os.PathLike, dst: str | os.PathLike, members: dict[str, list[int]] | None = None
) -> Path:
    """Copy ``src``'s dumps to ``dst`` with every group in ``pg_config`` (``members`` by group
    name; a group not given holds every rank that dumped). Returns ``dst``."""
    dumps = read_dumps(src)
    names = dump_files(src)
    out = Path(dst)
    out.mkdir(parents=True, exist_ok=False)
    groups: dict[str, str] = {}
    for dump in dumps.values():
        for e in dump["entries"]:
            groups.setdefault(str(e["process_group"][0]), str(e["process_group"][1]))
    config = {
        name: {
            "name": name,
            "desc": desc,
            "ranks": str(sorted((members or {}).get(name, sorted(dumps)))),
        }
        for name, desc in groups.items()
    }
    for rank, dump in dumps.items():
        (out / names[rank].name).write_bytes(pickle.dumps({**dump, "pg_config": config}))
    return out


def torchfrtrace_verdicts(folder: str | os.PathLike, *, quiet: bool = True) -> list[Verdict]:
    """torchfrtrace's matcher (``read_dir``, ``build_db``) on ``folder``: every collective it
    could not match on every member. Raises what torchfrtrace raises (``KeyError`` on a raw
    gloo dump of torch 2.13). ``quiet`` keeps its own report (logged at INFO) off stderr.
    """
    from torch.distributed.flight_recorder.components.builder import build_db
    from torch.distributed.flight_recorder.components.config_manager import JobConfig
    from torch.distributed.flight_recorder.components.loader import read_dir

    args = JobConfig().parse_args([str(folder)])
    log = logging.getLogger("Flight Recorder")  # torchfrtrace's logger (components/fr_logger.py)
    level = log.level
    if quiet:
        log.setLevel(logging.WARNING)
    try:
        details, version = read_dir(args)
        db = build_db(details, args, version)
    finally:
        log.setLevel(level)
    out = []
    for c in db.collectives:
        if c.missing_ranks:
            out.append(
                Verdict(c.collective_seq_id, c.group_id, tuple(sorted(c.missing_ranks)), "missing")
            )
        for rank, wrong in (c.mismatch_collectives or {}).items():
            state = wrong.type_of_mismatch.state.name if wrong.type_of_mismatch else "mismatch"
            out.append(Verdict(c.collective_seq_id, c.group_id, (rank,), state))
    return out
