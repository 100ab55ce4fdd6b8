"""The rank processes of a warm pool: their environment, how one starts, and how one exited.

Each rank is ``python -m dplab._worker`` with two inherited file descriptors: its end of a
duplex pipe (the calls and replies) and the read end of a lifeline pipe whose only writer is the
caller, so a rank sees the caller gone the moment it is (:mod:`dplab._worker`). Its output goes
to a log file in the pool's folder, named with the owner's pid so that a later pool can remove a
folder whose owner died without closing it.

The ranks run in a process group of their own: JupyterLab's stop button sends SIGINT to the
kernel's whole process group, and ranks in it died idle in ``recv_bytes()``. The interrupt is
the caller's (:class:`~dplab.launch.cluster.Cluster` stops a run it interrupts).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from multiprocessing import Pipe
from multiprocessing.connection import Connection

from dplab.env import pid_alive, usable_cpus
from dplab.launch.output import RankOutput

LOG_PREFIX = "dplab-ranks-"


def loopback_interface() -> str:
    """The loopback interface's name (``lo`` on Linux, ``lo0`` on macOS)."""
    with contextlib.suppress(OSError):
        names = [name for _, name in socket.if_nameindex()]
        for candidate in ("lo", "lo0"):
            if candidate in names:
                return candidate
    return "lo"


def describe_exit(code: int | None) -> str:
    """How a rank process ended, from its return code (a negative one is a signal)."""
    if code is None:
        return "is still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def remove_stale_logdirs() -> None:
    """Remove the log folders of pools whose owner process is gone (killed, kernel restart)."""
    pattern = re.compile(re.escape(LOG_PREFIX) + r"(\d+)-")
    root = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            match = pattern.match(name)
            if match and not pid_alive(int(match[1])):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def make_logdir() -> str:
    """A fresh log folder for a pool; the owner's pid is in its name (see the module's doc)."""
    return tempfile.mkdtemp(prefix=f"{LOG_PREFIX}{os.getpid()}-")


def rank_env(
    *,
    world_size: int,
    backend: str,
    port: int,
    logdir: str,
    counts_path: str,
    extra: dict[str, str],
) -> dict[str, str]:
    """The environment every rank starts with (the rank's own RANK is added by
    :func:`start_rank`): the store on 127.0.0.1, gloo on the loopback interface, the CPUs shared
    out, and the caller's ``extra`` last, so it wins."""
    threads = max(1, usable_cpus() // world_size)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        DPLAB_BACKEND=backend,
        DPLAB_PARENT_PID=str(os.getpid()),
        DPLAB_LOGDIR=str(logdir),
        DPLAB_COUNTS=counts_path,
        OMP_NUM_THREADS=str(threads),
        GLOO_SOCKET_IFNAME=loopback_interface(),
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def start_rank(
    rank: int, base_env: dict[str, str], logdir: str
) -> tuple[subprocess.Popen, Connection, int, RankOutput]:
    """Start rank ``rank``: its process, the caller's end of its pipe, the write end of its
    lifeline (close it and the rank exits), and its log."""
    parent_end, child_end = Pipe(duplex=True)
    life_read, life_write = os.pipe()
    log_path = os.path.join(str(logdir), f"rank{rank}.log")
    try:
        # O_APPEND: after the caller trims a flooded log, the rank writes at its new end.
        with open(log_path, "ab") as log:
            fds = [child_end.fileno(), life_read]
            proc = subprocess.Popen(
                [sys.executable, "-m", "dplab._worker", *map(str, fds)],
                pass_fds=fds,
                env=dict(base_env, RANK=str(rank), LOCAL_RANK=str(rank)),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=os.getcwd(),
                # Not in the caller's process group: the notebook's stop button (SIGINT to
                # the kernel's group) is for the caller, which stops what it interrupts.
                process_group=0,
            )
    finally:
        child_end.close()
        os.close(life_read)
    return proc, parent_end, life_write, RankOutput(rank, log_path)
