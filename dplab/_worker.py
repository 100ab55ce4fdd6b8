"""One rank process, started by :class:`dplab.launch.Cluster` (``python -m dplab._worker FD``).

It joins the process group once, then runs the functions the parent sends until told to stop.
A function arrives cloudpickled, so a function defined in a notebook cell runs here.

Every call carries an id and every reply repeats it, so a reply the parent did not read (an
interrupted call, a result it could not unpickle) can never be taken for the next call's.
The rank ignores SIGINT: it runs in its own process group, and an interrupt is the caller's to
handle (it stops a run it interrupts). A call that destroys the default process group is
reported with its reply, so the caller can restore the pool.

Each rank also counts the collectives it issues on the default group in a slot of a file the
parent maps (a flight recorder of one number): when one rank has returned and another has issued
more collectives than it, the parent knows they can never complete and says so at once.
"""

from __future__ import annotations

import faulthandler
import functools
import inspect
import mmap
import os
import re
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

from dplab.launch.protocol import CALL_HEADER, STOP

_DYNAMIC_FRAME = re.compile(r'  File "<dynamic-code>", line (?P<line>\d+), in (?P<name>\w+)$')

# Collectives every rank of the group must call the same number of times, in the same order.
# Point-to-point calls are left out on purpose: they are not symmetric.
COLLECTIVES = (
    "all_reduce",
    "all_reduce_coalesced",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "broadcast_object_list",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "barrier",
)


def _exit_with_parent(parent_pid: int, lifeline_fd: int, logdir: str) -> None:
    """Never outlive the caller: a kernel restart must not leave ranks behind.

    Two watcher threads: one blocks on a pipe whose only writer is the parent (EOF the moment
    the parent *process* is gone), one polls the parent's pid. Either removes the ranks' log
    folder, which a killed parent cannot, and exits. ``PR_SET_PDEATHSIG`` is not used: it fires
    when the *thread* that started the rank exits, so a Cluster created in a worker thread lost
    its ranks when that thread ended, and its SIGKILL left the log folder behind.
    """

    def lifeline() -> None:
        try:
            while os.read(lifeline_fd, 1):
                pass
        except OSError:
            pass
        _exit_as_orphan(logdir)

    def poll() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        _exit_as_orphan(logdir)

    threading.Thread(target=lifeline, daemon=True, name="dplab-lifeline").start()
    threading.Thread(target=poll, daemon=True, name="dplab-parent-watch").start()


def _exit_as_orphan(logdir: str) -> None:
    shutil.rmtree(logdir, ignore_errors=True)
    os._exit(1)


def _exit_on_lost_connection(parent_pid: int, logdir: str, within_s: float = 2.0) -> None:
    """The caller's end of the connection closed: exit, and clean up if the caller died.

    A killed caller closes its files before the kernel hands its children to a new parent, so
    the EOF can arrive while ``getppid()`` still names the dead caller; wait briefly for the
    handover. Exiting at once left the log folder behind whenever every rank saw the EOF before
    its watcher threads ran (2 abrupt exits in 15 with a CPU hog). A live caller that closed the
    connection has killed the rank or is about to, and removes the folder itself.
    """
    deadline = time.monotonic() + within_s
    while os.getppid() == parent_pid and time.monotonic() < deadline:
        time.sleep(0.01)
    if os.getppid() != parent_pid:
        _exit_as_orphan(logdir)
    os._exit(1)


def _group_position(fn: Callable) -> int | None:
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return names.index("group") if "group" in names else None


def count_collectives(counts: Any, rank: int) -> None:
    """Wrap torch.distributed's collectives so each one on the default group bumps our slot.

    The count is raised *before* the collective starts, so while a rank waits inside its n-th
    collective its slot reads n.
    """
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    def on_world(group: Any) -> bool:
        return group is None or group is dist.GroupMember.WORLD

    for name in COLLECTIVES:
        real = getattr(c10d, name, None)
        if real is None or getattr(real, "_dplab_counted", False):
            continue
        position = _group_position(real)

        def counted(*args: Any, __real: Callable = real, __pos: int | None = position, **kw: Any):
            group = args[__pos] if __pos is not None and len(args) > __pos else kw.get("group")
            if on_world(group):
                counts[rank] += 1
            return __real(*args, **kw)

        wrapped = functools.wraps(real)(counted)
        wrapped._dplab_counted = True  # type: ignore[attr-defined]
        # Both names stay one function (``dist.all_reduce is c10d.all_reduce``), as in torch: code
        # that patches collectives (a CommCounter, a checker) finds and wraps them where it looks.
        for module in (dist, c10d):
            if getattr(module, name, None) is real:
                setattr(module, name, wrapped)


def _open_counts(path: str, world_size: int) -> Any:
    fd = os.open(path, os.O_RDWR)
    try:
        shared = mmap.mmap(fd, 8 * world_size)
    finally:
        os.close(fd)
    return memoryview(shared).cast("q")


def _join_process_group(rank: int, world_size: int, backend: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size + 1,
        False,
        timeout=timedelta(seconds=120),
    )
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)


def _name_dynamic_frames(text: str, sources: dict[str, tuple[str, list[str]]]) -> str:
    """Put back the file name and source line that cloudpickle dropped from shipped functions."""
    out = []
    for line in text.splitlines():
        match = _DYNAMIC_FRAME.match(line)
        if match and match["name"] in sources:
            filename, lines = sources[match["name"]]
            number = int(match["line"])
            out.append(f'  File "{filename}", line {number}, in {match["name"]}')
            if 0 < number <= len(lines) and lines[number - 1].strip():
                out.append("    " + lines[number - 1].strip())
            continue
        out.append(line)
    return "\n".join(out) + "\n"


def run_call(payload: bytes) -> tuple[str, object]:
    """Unpickle one call (:func:`dplab.launch.protocol.pickle_call`), run it, and report
    ``("ok", pickled result)`` or ``("error", traceback)``; never raises."""
    import cloudpickle

    sources: dict = {}
    try:
        path, sources, call = cloudpickle.loads(payload)
        for entry in path:
            if entry not in sys.path:
                sys.path.append(entry)
        fn, args, kwargs = cloudpickle.loads(call)
        result = fn(*args, **kwargs)
    except BaseException:
        return "error", _name_dynamic_frames(traceback.format_exc(), sources)
    try:
        return "ok", cloudpickle.dumps(result)
    except Exception as e:
        return "error", f"the rank's return value cannot be pickled: {e!r}"


def _group_lost() -> bool:
    """The call destroyed the default process group (``dist.destroy_process_group()``)."""
    import torch.distributed as dist

    return not dist.is_initialized()


def main() -> None:
    # Interrupts are the caller's (a stop button, a Ctrl-C): it stops a run it interrupts.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(int(sys.argv[1]))
    logdir = os.environ["DPLAB_LOGDIR"]
    parent_pid = int(os.environ["DPLAB_PARENT_PID"])
    _exit_with_parent(parent_pid, int(sys.argv[2]), logdir)
    # The parent sends SIGUSR1 to learn where a stuck rank is: the stacks go to our log.
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    counts = _open_counts(os.environ["DPLAB_COUNTS"], world_size)
    try:
        _join_process_group(rank, world_size, os.environ["DPLAB_BACKEND"])
        count_collectives(counts, rank)
    except BaseException:
        conn.send((0, "error", traceback.format_exc(), counts[rank]))
        os._exit(1)
    import cloudpickle

    conn.send((0, "ok", cloudpickle.dumps(None), counts[rank]))  # "ready"
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            _exit_on_lost_connection(parent_pid, logdir)
        if message == STOP:
            break
        _, call_id = CALL_HEADER.unpack_from(message)
        kind, body = run_call(message[CALL_HEADER.size :])
        sys.stdout.flush()
        sys.stderr.flush()
        conn.send((call_id, kind, body, counts[rank], _group_lost()))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    conn.close()


if __name__ == "__main__":
    main()
