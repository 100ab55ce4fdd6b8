"""Where a stuck rank is: its main thread's stack, read from the dump faulthandler writes.

Each rank registers faulthandler on SIGUSR1 (:mod:`dplab._worker`), writing every thread's stack
to its log. When a call times out, or one rank waits in a collective another never issued, the
caller signals the rank and reads the dump back, so the error names the line the rank waits on
instead of only saying that it waits.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Mapping, Sequence

from dplab.launch.output import RankOutput

_STACK_LINE = re.compile(r'^\s+File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<name>\S+)')


def main_thread_stack(dump: str) -> str:
    """The user's frames of the rank's main thread in a faulthandler dump, innermost last."""
    for block in dump.split("\n\n"):
        frames = [m for line in block.splitlines() if (m := _STACK_LINE.match(line))]
        names = [m["name"] for m in frames]
        if "main" in names and "run_call" in names:
            user = frames[: names.index("run_call")]  # faulthandler lists the innermost first
            return "\n".join(
                f'  File "{m["file"]}", line {m["line"]}, in {m["name"]}' for m in reversed(user)
            )
    return ""


def dump_stacks(pids: Mapping[int, int], logs: Sequence[RankOutput]) -> dict[int, str]:
    """Where each rank of ``pids`` (rank → process id) is now; a rank whose dump does not come
    within 1 s is left out. The dumps are skipped in the logs, so they are never relayed."""
    sizes = {}
    for rank, pid in pids.items():
        with contextlib.suppress(OSError):
            sizes[rank] = logs[rank].size()
            os.kill(pid, signal.SIGUSR1)
    out: dict[int, str] = {}
    deadline = time.monotonic() + 1.0
    while sizes and time.monotonic() < deadline:
        time.sleep(0.05)
        for rank in list(sizes):
            stack = main_thread_stack(logs[rank].read_from(sizes[rank]))
            if stack:
                out[rank] = stack
                del sizes[rank]
    time.sleep(0.05)  # the dump's last lines
    for rank in pids:
        logs[rank].skip_to_end()
    return out
