"""Which rank is behind: every rank's flight-recorder dump, read side by side.

torch's flight recorder (``TORCH_FR_BUFFER_SIZE=N``) keeps each rank's last N collectives: the
group, the group's collective number (``collective_seq_id``), the op, the tensor sizes, the
Python stack that issued it. Collectives pair up by that number: every member's n-th collective
on a group must be the same call. So the first number at which the members' records disagree is
where the job went wrong, and its kind says how:

- a member has no record of it: that rank **never issued** it (it is behind, or it skipped it);
- a member issued another call under that number, and its call is what the others issued *next*:
  it skipped the others' call and went on (also "never issued");
- otherwise it **issued it differently** (another op, other sizes). With no majority (2 ranks,
  one against one) the dumps cannot say which side is wrong; like torch's ``torchfrtrace`` this
  names the ranks that differ from the lowest rank, and says so.

The dumps are read as torch writes them: one pickle per rank in one folder, named
``<prefix><rank>`` (``TORCH_FR_DUMP_TEMP_FILE`` is the prefix on NCCL), the layout torch's
``torchfrtrace`` reads. Gloo dumps of torch 2.13 leave ``pg_config`` without the groups (one
entry keyed ``''``), which is why torchfrtrace fails on them with a ``KeyError``; here a group
absent from ``pg_config`` is taken to hold every rank that dumped, and the report says so.
Only unpickle dumps you wrote: a pickle can run code when it is read.
"""

from __future__ import annotations

import ast
import os
import pickle
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_RANK_SUFFIX = re.compile(r"^(.*?)(\d+)$")


@dataclass(frozen=True)
class Call:
    """One recorded collective of one rank, as the dump gives it."""

    rank: int
    group: str
    seq: int
    op: str  # the profiling name without its backend: "all_reduce", "barrier"
    sizes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    created_ns: int
    where: str  # the innermost frame outside torch: what the rank's code was doing
    state: str = "scheduled"  # NCCL: scheduled, started, completed; gloo: always scheduled

    @property
    def fingerprint(self) -> tuple:
        """What must be equal on every member for two calls to be the same collective."""
        return self.op, self.sizes, self.dtypes

    def what(self) -> str:
        """The op and its input sizes: ``all_reduce [4]``."""
        return self.op + "".join(f" {list(s)}" for s in self.sizes)

    def describe(self) -> str:
        return f"#{self.seq} {self.what()}"


@dataclass(frozen=True)
class Mismatch:
    """The first collective number at which a group's members disagree."""

    group: str
    seq: int
    behind: tuple[int, ...]
    kind: str  # "never issued" or "issued differently"
    reference: Call  # the call the other members issued under that number
    calls: dict[int, Call | None]  # every member's call under that number (None: none)
    tie: bool  # one against one: the dumps cannot say which side is wrong


@dataclass
class HangReport:
    """Every group's verdict, and what each rank was doing when it dumped."""

    ranks: list[int]
    version: str
    backend: str
    members: dict[str, tuple[int, ...]]
    assumed: list[str]  # groups whose members the dumps do not list
    mismatches: list[Mismatch]  # earliest first
    last: dict[int, Call | None]  # each rank's last recorded call, any group
    status: dict[int, dict[str, Any]] = field(default_factory=dict)

    @property
    def first(self) -> Mismatch | None:
        return self.mismatches[0] if self.mismatches else None

    def summary(self) -> str:
        """The report the CLI prints; its ``behind:`` line names the rank and the number."""
        lines = [
            f"flight recorder: {len(self.ranks)} dumps (ranks {self.ranks}), format "
            f"{self.version}, backend {self.backend}"
        ]
        for group, members in sorted(self.members.items()):
            note = " (not in the dumps' pg_config: assumed every rank that dumped)"
            lines.append(
                f"group {group}: members {list(members)}" + (note if group in self.assumed else "")
            )
        m = self.first
        if m is None:
            lines.append(
                "behind: none: every member issued the same collectives on every group; a hang "
                "inside a matched collective is the network or a rank stuck in it (read "
                "NCCL_DEBUG=INFO, run nccl-tests)"
            )
        for i, m in enumerate(self.mismatches):
            lines.append(("behind: " if i == 0 else "also: ") + _verdict(m))
            lines.append(f"first mismatch: group {m.group} {m.reference.describe()}")
            for rank, call in sorted(m.calls.items()):
                lines.append(f"  rank {rank}: {call.describe() if call else 'nothing'}")
            if m.tie:
                lines.append(
                    "  one against one: the dumps cannot say which side is wrong (named: the "
                    "side that differs from the lowest rank); read both stacks"
                )
        lines.append("what each rank was doing (its last recorded collective):")
        for rank in self.ranks:
            call = self.last.get(rank)
            doing = (
                f"group {call.group} {call.describe()} ({call.state}) from {call.where}"
                if call
                else "none"
            )
            lines.append(f"  rank {rank}: {doing}{_status(self.status.get(rank, {}))}")
        return "\n".join(lines)


def _verdict(m: Mismatch) -> str:
    who = ", ".join(f"rank {r}" for r in m.behind)
    if m.kind == "never issued":
        by = sorted(r for r, c in m.calls.items() if c and c.fingerprint == m.reference.fingerprint)
        return (
            f"{who} never issued collective #{m.seq} on group {m.group} "
            f"({m.reference.what()}, issued by rank {by[0] if by else '?'})"
        )
    theirs = "; ".join(
        f"rank {r}: {c.what() if (c := m.calls[r]) else 'nothing'}" for r in m.behind
    )
    return (
        f"{who} issued collective #{m.seq} on group {m.group} differently ({theirs}; "
        f"the others: {m.reference.what()})"
    )


def _status(status: dict[str, Any]) -> str:
    if not status:
        return ""
    parts = [
        f"group {g}: last enqueued #{s.get('last_enqueued_collective')}, "
        f"last completed #{s.get('last_completed_collective')}"
        for g, s in sorted(status.items())
    ]
    return " [" + "; ".join(parts) + "]"


def dump_files(folder: str | os.PathLike, prefix: str | None = None) -> dict[int, Path]:
    """Each rank's dump in ``folder``: files named ``<prefix><rank>``, the prefix inferred when
    every such file shares one (as torchfrtrace infers it)."""
    root = Path(folder)
    if not root.is_dir():
        what = "does not exist" if not root.exists() else "is not a folder"
        raise ValueError(f"flight-recorder folder {str(folder)!r} {what}")
    by_prefix: dict[str, dict[int, Path]] = {}
    for path in sorted(root.iterdir()):
        match = _RANK_SUFFIX.match(path.name)
        if path.is_file() and match:
            by_prefix.setdefault(match[1], {})[int(match[2])] = path
    if prefix is None:
        if len(by_prefix) != 1:
            found = sorted(by_prefix) or "none"
            raise ValueError(
                f"{str(folder)!r} should hold one dump per rank named <prefix><rank>; "
                f"prefixes found: {found}"
            )
        prefix = next(iter(by_prefix))
    if prefix not in by_prefix:
        raise ValueError(f"no file in {str(folder)!r} is named {prefix!r} followed by a rank")
    return dict(sorted(by_prefix[prefix].items()))


def read_dumps(folder: str | os.PathLike, prefix: str | None = None) -> dict[int, dict]:
    """Every rank's dump, unpickled, by rank; a file that is not a dump is named in the error."""
    dumps = {}
    for rank, path in dump_files(folder, prefix).items():
        try:
            with open(path, "rb") as f:
                dump = pickle.load(f)
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as e:
            raise ValueError(f"{path.name} is not a flight-recorder dump: {e}") from None
        if not isinstance(dump, dict) or not isinstance(dump.get("entries"), list):
            raise ValueError(f"{path.name} is not a flight-recorder dump (no 'entries' list)")
        dumps[rank] = dump
    return dumps


def _where(frames: list[dict]) -> str:
    torch_dir = f"{os.sep}torch{os.sep}"
    for frame in frames or []:
        filename = str(frame.get("filename", ""))
        if torch_dir not in filename:
            short = os.sep.join(Path(filename).parts[-2:])
            return f"{frame.get('name', '?')} ({short}:{frame.get('line', '?')})"
    return "unknown (no stack recorded)"


def calls_of(rank: int, dump: dict) -> list[Call]:
    """The rank's recorded collectives (point-to-point sends and receives left out), in order."""
    out = []
    for e in dump["entries"]:
        if e.get("is_p2p") or int(e.get("collective_seq_id", 0)) <= 0:
            continue
        name = str(e.get("profiling_name", "?"))
        out.append(
            Call(
                rank,
                str(e["process_group"][0]),
                int(e["collective_seq_id"]),
                name.split(":", 1)[-1],
                tuple(tuple(int(d) for d in s) for s in e.get("input_sizes", [])),
                tuple(str(d) for d in e.get("input_dtypes", [])),
                int(e.get("time_created_ns") or 0),
                _where(e.get("frames", [])),
                str(e.get("state", "scheduled")),
            )
        )
    return sorted(out, key=lambda c: (c.group, c.seq))


def _members(dumps: dict[int, dict], group: str) -> tuple[int, ...] | None:
    for dump in dumps.values():
        config = dump.get("pg_config", {}).get(group)
        if config:
            ranks = config.get("ranks", "[]")
            ranks = ast.literal_eval(ranks) if isinstance(ranks, str) else ranks
            if ranks:
                return tuple(sorted(int(r) for r in ranks))
    return None


def _first_mismatch(group: str, members: tuple[int, ...], calls: dict[int, dict[int, Call]],
                    issued: dict[int, int]) -> Mismatch | None:  # fmt: skip
    recorded = [min(calls[r]) for r in members if calls[r]]
    start = max(recorded) if recorded else 1  # a ring buffer forgets the oldest
    for seq in range(start, max(issued[r] for r in members) + 1):
        here = {r: calls[r].get(seq) for r in members}
        never = tuple(r for r in members if here[r] is None and seq > issued[r])
        present = {r: c for r, c in here.items() if c is not None}
        if not present:
            continue
        counts = Counter(c.fingerprint for c in present.values())
        if not never and len(counts) == 1:
            continue
        # the call most members issued; one against one, the lowest rank's (torchfrtrace's rule)
        top = max(counts.values())
        ref = next(c for r, c in sorted(present.items()) if counts[c.fingerprint] == top)
        tie = not never and sum(1 for n in counts.values() if n == top) > 1
        if never:
            return Mismatch(group, seq, never, "never issued", ref, here, False)
        # a rank whose call is what another rank issued next skipped that rank's call
        skipped = tuple(
            r
            for r, c in present.items()
            if any(
                (nxt := calls[q].get(seq + 1)) is not None
                and nxt.fingerprint == c.fingerprint
                and present[q].fingerprint != c.fingerprint
                for q in present
            )
        )
        if skipped and len(skipped) < len(present):
            ref = next(c for r, c in sorted(present.items()) if r not in skipped)
            return Mismatch(group, seq, tuple(sorted(skipped)), "never issued", ref, here, False)
        differ = tuple(r for r, c in sorted(present.items()) if c.fingerprint != ref.fingerprint)
        return Mismatch(group, seq, differ, "issued differently", ref, here, tie)
    return None


def analyze(dumps: dict[int, dict]) -> HangReport:
    """Line every rank's records up by group and collective number; find who is behind."""
    if not dumps:
        raise ValueError("no flight-recorder dumps to read")
    ranks = sorted(dumps)
    per_rank = {r: calls_of(r, d) for r, d in dumps.items()}
    groups = sorted({c.group for cs in per_rank.values() for c in cs})
    members: dict[str, tuple[int, ...]] = {}
    assumed = []
    mismatches = []
    for group in groups:
        listed = _members(dumps, group)
        if listed is not None and not set(listed) <= set(ranks):
            missing = sorted(set(listed) - set(ranks))
            raise ValueError(
                f"group {group} has members {list(listed)} but there is no dump of rank(s) "
                f"{missing}: every member's dump is needed to say who is behind"
            )
        members[group] = listed if listed is not None else tuple(ranks)
        if listed is None:
            assumed.append(group)
        calls = {
            r: {c.seq: c for c in per_rank.get(r, []) if c.group == group} for r in members[group]
        }
        issued = {}
        for r in members[group]:
            status = dumps.get(r, {}).get("pg_status", {}).get(group, {})
            enqueued = int(status.get("last_enqueued_collective", 0) or 0)
            issued[r] = max([enqueued, *calls[r]])
        found = _first_mismatch(group, members[group], calls, issued)
        if found is not None:
            mismatches.append(found)
    mismatches.sort(key=lambda m: min(c.created_ns for c in m.calls.values() if c is not None))
    backends = {
        str(e.get("profiling_name", "?")).split(":")[0]
        for d in dumps.values()
        for e in d["entries"]
    }
    return HangReport(
        ranks,
        str(next(iter(dumps.values())).get("version", "?")),
        ", ".join(sorted(backends)) or "unknown",
        members,
        assumed,
        mismatches,
        {r: (max(cs, key=lambda c: c.created_ns) if cs else None) for r, cs in per_rank.items()},
        {r: dict(d.get("pg_status", {})) for r, d in dumps.items()},
    )


def read_flight_recorder(folder: str | os.PathLike, prefix: str | None = None) -> HangReport:
    """:func:`analyze` of every dump in ``folder`` (``dplab doctor --flight-recorder DIR``)."""
    return analyze(read_dumps(folder, prefix))
