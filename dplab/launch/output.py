"""What a rank prints: kept in a log file, relayed to the caller prefixed by rank, capped.

A debug print in an endless loop writes ~119 MiB/s; at a 300 s timeout that is ~35 GiB of log
and a notebook that tries to show all of it (Jupyter drops output past its rate limit anyway).
So each rank's output is capped per call: the first ``OUTPUT_CAP_BYTES`` are shown, the rest is
dropped with one line saying how much. While a call runs, the caller trims a log that grows past
the cap (the rank writes with O_APPEND, so after a truncation it writes at the new end), which
bounds the disk the log takes to about the cap plus what a rank writes between two looks.

One kind of line is kept in the log but not relayed: the USDT probe markers torch's profiler
(Kineto) prints to stderr each time it starts and stops, ``USDT:<time> <pid>:<tid>
SyncActivityProfilerHandler.cpp:52] profiler_start``. A traced run starts a profiler on every
rank, so a lesson's cell would show a red block of them that says nothing to a learner.
``KINETO_LOG_LEVEL`` hides them only when set past every level it has (6 with torch 2.13), which
would hide whatever else Kineto has to say.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from typing import TextIO

from dplab._units import MIB

OUTPUT_CAP_BYTES = 2 * MIB  # per rank and call
TAIL_BYTES = 64 * 1024  # what a dead rank's last lines are read from
PROFILER_MARKER = re.compile(r"^USDT:.*\] profiler_(start|stop)\s*$")  # Kineto's, see above


class RankOutput:
    """One rank's log: what it printed since the caller last looked, within this call's cap."""

    def __init__(self, rank: int, path: str, *, cap_bytes: int = OUTPUT_CAP_BYTES):
        self.rank = rank
        self.path = path
        self.cap_bytes = cap_bytes
        self._file = open(path, "rb")  # noqa: SIM115 (kept open to tail)
        self._held = b""  # read while trimming, not shown yet
        self._shown = 0  # bytes shown (or held) in this call
        self._dropped = 0  # bytes dropped in this call

    def new_call(self) -> None:
        """Each call gets the whole cap again."""
        self._shown = self._dropped = 0

    def size(self) -> int:
        with contextlib.suppress(OSError):
            return os.path.getsize(self.path)
        return 0

    def _take(self) -> bytes:
        """Read what is new, up to what is left of the cap; count the rest as dropped."""
        room = max(0, self.cap_bytes - self._shown)
        data = self._file.read(room) if room else b""
        self._shown += len(data)
        rest = self.size() - self._file.tell()
        if rest > 0 and self._shown >= self.cap_bytes:
            self._dropped += rest
            self._file.seek(0, os.SEEK_END)
        return data

    def trim(self) -> None:
        """While a call runs: a log past the cap is read up to it and truncated (disk bounded)."""
        with contextlib.suppress(OSError, ValueError):
            if self.size() - self._file.tell() <= self.cap_bytes:
                return
            self._held += self._take()
            os.truncate(self.path, 0)
            self._file.seek(0)

    def relay(self, stream: TextIO | None = None) -> None:
        """Show what is new, each line prefixed by the rank; say how much the cap dropped."""
        with contextlib.suppress(OSError, ValueError):
            data, self._held = self._held + self._take(), b""
            stream = stream or sys.stderr
            for line in data.decode(errors="replace").splitlines():
                if not PROFILER_MARKER.match(line):
                    print(f"[rank {self.rank}] {line}", file=stream)
            if self._dropped:
                print(
                    f"[rank {self.rank}] … {self._dropped / 1e6:.1f} MB of output dropped (each "
                    f"rank shows at most {self.cap_bytes / 1e6:.1f} MB per call: return values "
                    "rather than print them)",
                    file=stream,
                )
                self._dropped = 0

    def read_from(self, offset: int) -> str:
        """The log from ``offset`` on (a stack dump the rank just wrote), not shown."""
        with contextlib.suppress(OSError), open(self.path, "rb") as f:
            f.seek(offset)
            return f.read(TAIL_BYTES).decode(errors="replace")
        return ""

    def skip_to_end(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._file.seek(0, os.SEEK_END)

    def tail(self, lines: int = 30) -> str:
        """The last lines the rank wrote (to say what a rank that died was doing)."""
        with contextlib.suppress(OSError), open(self.path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - TAIL_BYTES))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
        return ""

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._file.close()
