"""One rank under torchrun on a node (``python -m dplab.nodes._rank RUNDIR [-m MODULE ARGS…]``).

torchrun starts this once per local rank after the rendezvous, with ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` … set. It first leaves a marker in ``RUNDIR/started`` (so the caller can tell
"the rendezvous never completed" from "a rank failed"), then either runs the module (which may
call :func:`dplab.launch`: under torchrun that runs in place) or joins the process group and runs
the pickled call in ``RUNDIR/call.pkl`` the way a :class:`dplab.Cluster` rank does, writing
``("ok"|"error", body, time)`` to ``RUNDIR/result<rank>.pkl``. Files, not sockets: the
namespaces share the file system, and nothing has to listen anywhere.
"""

from __future__ import annotations

import os
import pickle
import runpy
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _run_call(rundir: Path, rank: int, timeout_s: float) -> int:
    import torch
    import torch.distributed as dist

    from dplab._worker import run_call  # the same unpickle-run-report as a Cluster rank

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    kind, body = run_call((rundir / "call.pkl").read_bytes())
    # The time says which rank failed first: its peers fail next, on the connections it closed.
    _write(rundir / f"result{rank}.pkl", pickle.dumps((kind, body, time.time())))
    if kind == "error":
        sys.stdout.flush()
        sys.stderr.flush()
        # The other ranks may wait in a collective this one never joins: the caller stops them.
        os._exit(1)
    # Every rank has written its result: meet once more, then leave without the interpreter's
    # teardown. A gloo worker thread drops its last collective's tensors only after wait() has
    # returned, which needs the GIL; a rank that reached finalization first was aborted ("terminate
    # called without an active exception", SIGABRT, after every result was written). The barrier
    # hands the GIL over; leaving with os._exit skips the finalization altogether.
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> int:
    rundir = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    node = os.environ.get("DPLAB_NODE", "?")
    marker = f"{node} {os.getpid()} {socket.gethostname()}"
    _write(rundir / "started" / f"rank{rank}", marker.encode())
    if len(sys.argv) > 2 and sys.argv[2] == "-m":
        module, sys.argv = sys.argv[3], [sys.argv[3], *sys.argv[4:]]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    return _run_call(rundir, rank, float(os.environ.get("DPLAB_PG_TIMEOUT_S", "600")))


if __name__ == "__main__":
    sys.exit(main())
