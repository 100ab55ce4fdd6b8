"""The lines of an NCCL job's log worth reading when it hangs, picked out and parsed.

torch's NCCL watchdog (``ProcessGroupNCCL.cpp``) prints, for a collective past its timeout,
``Watchdog caught collective operation timeout: WorkNCCL(SeqNum=N, OpType=OP, NumelIn=...,
NumelOut=..., Timeout(ms)=...) ran for T milliseconds before timing out``, then ``failure
detected by watchdog at work sequence id: N PG status: last enqueued work: E, last completed
work: C``. N is the group's collective number, the one the flight recorder keeps; E > C means the
rank issued collectives that never finished, and a rank whose E is below the others' N never
issued collective N. With ``NCCL_DEBUG=INFO`` NCCL itself says which transport it chose: ``NET/IB
: No device found`` then ``Using network Socket`` is a job on TCP sockets, not InfiniBand; ``via
P2P/IPC``, ``via SHM`` or ``via NET`` names the path between two GPUs of a channel.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

# A hang recorded on a lent H200 (torch 2.11, NCCL 2.28.9, world size 1, a 5 s timeout): the
# job's log with NCCL_DEBUG=INFO, and the flight-recorder dump its watchdog wrote.
RECORDED_HANG = Path(__file__).resolve().parents[2] / "assets" / "nccl_hang_h200"
RECORDED_LOG = RECORDED_HANG / "nccl_hang.log"

_WORK = re.compile(
    r"\[Rank (?P<rank>\d+)\] Watchdog caught collective operation timeout: WorkNCCL\("
    r"SeqNum=(?P<seq>\d+), OpType=(?P<op>\w+), NumelIn=(?P<numel_in>\d+), "
    r"NumelOut=(?P<numel_out>\d+), Timeout\(ms\)=(?P<timeout_ms>\d+)\) "
    r"ran for (?P<ran_ms>\d+) milliseconds"
)
_STATUS = re.compile(
    r"Rank (?P<rank>\d+)\]\s+failure detected by watchdog at work sequence id: (?P<seq>\d+) "
    r"PG status: last enqueued work: (?P<enqueued>-?\d+), last completed work: (?P<completed>-?\d+)"
)
_TRANSPORT = re.compile(r"NCCL INFO (NET/IB : No device found|Using network \w+|.* via \S+)")


@dataclass(frozen=True)
class WatchdogTimeout:
    """One watchdog line: which collective of which rank ran past its timeout."""

    rank: int
    seq: int
    op: str
    numel_in: int
    timeout_ms: int
    ran_ms: int


@dataclass(frozen=True)
class GroupStatus:
    """One ``failure detected by watchdog`` line: the group's last enqueued and completed work."""

    rank: int
    seq: int
    last_enqueued: int
    last_completed: int


@dataclass(frozen=True)
class NcclLog:
    """What a hung job's log says: the timeouts, the group status, the transport NCCL chose."""

    timeouts: list[WatchdogTimeout]
    statuses: list[GroupStatus]
    transport: list[str]


def read_nccl_log(text: str) -> NcclLog:
    """The watchdog lines, the PG-status lines and NCCL's transport lines of ``text``, in order
    (a line printed twice, as the watchdog's exception repeats it, counted once)."""
    timeouts = list(dict.fromkeys(
        WatchdogTimeout(int(m["rank"]), int(m["seq"]), m["op"], int(m["numel_in"]),
                        int(m["timeout_ms"]), int(m["ran_ms"]))
        for m in _WORK.finditer(text)
    ))  # fmt: skip
    statuses = list(dict.fromkeys(
        GroupStatus(int(m["rank"]), int(m["seq"]), int(m["enqueued"]), int(m["completed"]))
        for m in _STATUS.finditer(text)
    ))  # fmt: skip
    transport = list(dict.fromkeys(m[1] for m in _TRANSPORT.finditer(text)))
    return NcclLog(timeouts, statuses, transport)
