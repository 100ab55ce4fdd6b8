"""One rank process, started by :class:`dplab.launch.Cluster` (``python -m dplab._worker FD``).

It joins the process group once, then runs the functions the parent sends until told to stop.
A function arrives cloudpickled, so a function defined in a notebook cell runs here.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection

_DYNAMIC_FRAME = re.compile(r'  File "<dynamic-code>", line (?P<line>\d+), in (?P<name>\w+)$')


def _exit_with_parent(parent_pid: int) -> None:
    """Never outlive the caller: a kernel restart must not leave ranks behind."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            import signal

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True, name="dplab-parent-watch").start()


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


def _run(payload: bytes) -> tuple[str, object]:
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


def main() -> None:
    conn = Connection(int(sys.argv[1]))
    _exit_with_parent(int(os.environ["DPLAB_PARENT_PID"]))
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        _join_process_group(rank, world_size, os.environ["DPLAB_BACKEND"])
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        os._exit(1)
    import cloudpickle

    conn.send(("ok", cloudpickle.dumps(None)))  # "ready"
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            os._exit(1)
        if message == b"S":
            break
        kind, body = _run(message)
        conn.send((kind, body))
        if kind == "error":
            sys.stdout.flush()
            sys.stderr.flush()
    import torch.distributed as dist

    dist.destroy_process_group()
    conn.close()


if __name__ == "__main__":
    main()
