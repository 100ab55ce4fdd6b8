"""A job that hangs for real: N fresh rank processes whose *default* group times out in seconds.

A hang on the default group breaks that group for good (the ranks' collective counters no longer
agree), so it cannot run in the warm pool the other failures share: the pool would stop both
ranks the moment one returned, before torch's own timeout or any flight-recorder dump. Here each
job is what a user's ``torchrun`` job is: N processes that join one gloo group with a short
``timeout`` (:func:`torch.distributed.init_process_group`), run one scenario of
:mod:`dplab.failures.hangs`, and, like ``TORCH_NCCL_DUMP_ON_TIMEOUT`` does on NCCL, write their
flight-recorder dump to ``<folder>/<prefix><rank>`` (the layout ``torchfrtrace`` reads). Gloo has
no watchdog that dumps, so each rank dumps itself after its collective raised.

Nothing is left behind: the rendezvous store lives in the caller, bound to 127.0.0.1; every rank
waits for the others at the store (not in a collective) before it exits, so a rank that skipped
a collective does not close its sockets under a partner still waiting in it; a job that overruns
its deadline is killed, rank by rank, and raises.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from dplab import _checks
from dplab.failures._common import check_wait

DUMP_PREFIX = "trace_rank_"  # torch's default TORCH_FR_DUMP_TEMP_FILE ends the same way
RESULT_MARK = "DPLAB_JOB_RESULT "
START_S = 60.0  # starting the ranks and importing torch, on two busy cores


@dataclass(frozen=True)
class RankOutcome:
    """One rank of a job: the error it raised (None if none), its stderr, seconds in the run."""

    rank: int
    error: str | None
    stderr: str
    seconds: float


@dataclass(frozen=True)
class JobRun:
    """A finished job: each rank's outcome and the folder of its flight-recorder dumps."""

    scenario: str
    folder: Path
    ranks: list[RankOutcome]

    @property
    def errors(self) -> list[str | None]:
        """Each rank's error, by rank."""
        return [r.error for r in self.ranks]


def _store(world_size: int) -> tuple[Any, int]:
    """The rendezvous store, listening on 127.0.0.1 only (TCPStore's own bind takes every
    interface), and its port."""
    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    store = dist.TCPStore(
        "127.0.0.1",
        port,
        world_size + 1,
        True,
        timeout=timedelta(seconds=START_S),
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
    )
    return store, port


def run_job(
    scenario: str,
    world_size: int = 2,
    *,
    folder: str | os.PathLike,
    timeout_s: float = 2.0,
    debug: str = "OFF",
    **params: Any,
) -> JobRun:
    """Run ``scenario`` (a name in :data:`dplab.failures.hangs.SCENARIOS`) on ``world_size``
    fresh ranks whose default group times out after ``timeout_s``; dumps go to ``folder``.

    ``folder`` must be empty or absent: torchfrtrace reads every file in it as a rank's dump.
    ``debug`` is ``TORCH_DISTRIBUTED_DEBUG`` for the ranks: ``DETAIL`` makes torch compare every
    collective's op and shapes across ranks before running it, and name a mismatch.
    """
    from dplab.failures.hangs import SCENARIOS

    _checks.check_choice("scenario", scenario, tuple(SCENARIOS))
    world_size = _checks.check_positive_int("world_size", world_size)
    if world_size < 2:
        raise ValueError(f"world_size must be at least 2 for a hang, got {world_size}")
    timeout_s = check_wait("timeout_s", timeout_s)
    _checks.check_choice("debug", debug, ("OFF", "INFO", "DETAIL"))
    out = Path(folder)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"folder {str(out)!r} is not empty: it must hold only this job's dumps")
    out.mkdir(parents=True, exist_ok=True)
    store, port = _store(world_size)
    spec = json.dumps({"scenario": scenario, "timeout_s": timeout_s, "params": params})
    env = dict(os.environ)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        TORCH_FR_BUFFER_SIZE=env.get("TORCH_FR_BUFFER_SIZE", "64"),
        TORCH_FR_DUMP_TEMP_FILE=str(out / DUMP_PREFIX),
        GLOO_SOCKET_IFNAME="lo",
        TORCH_DISTRIBUTED_DEBUG=debug,
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "dplab.failures.job", spec],
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world_size)
    ]
    deadline = time.monotonic() + START_S + 4 * timeout_s
    outputs: list[tuple[str, str]] = []
    try:
        for proc in procs:
            left = max(0.1, deadline - time.monotonic())
            outputs.append(proc.communicate(timeout=left))
    except subprocess.TimeoutExpired:
        raise TimeoutError(
            f"job {scenario!r} did not finish within {START_S + 4 * timeout_s:.0f} s: "
            "its ranks were stopped"
        ) from None
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        del store
    return JobRun(
        scenario, out, [_outcome(r, *o, procs[r].returncode) for r, o in enumerate(outputs)]
    )


def _outcome(rank: int, stdout: str, stderr: str, code: int | None) -> RankOutcome:
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_MARK)]
    if not lines:
        raise RuntimeError(
            f"rank {rank} exited with code {code} and no result; its stderr ends:\n{stderr[-2000:]}"
        )
    result = json.loads(lines[-1][len(RESULT_MARK) :])
    return RankOutcome(rank, result["error"], stderr, result["seconds"])


def dump_flight_record(path: str) -> None:
    """Write this process's flight-recorder dump to ``path`` as torch pickles it (the bytes
    ``TORCH_NCCL_DUMP_ON_TIMEOUT`` writes on NCCL; gloo has no watchdog to do it)."""
    import torch

    data = torch._C._distributed_c10d._dump_fr_trace()
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)  # a reader never sees half a dump
    pickle.loads(data)  # torch wrote a pickle: fail here, not in the analyzer, if not


def _rank_main(spec: dict[str, Any]) -> None:
    import torch.distributed as dist

    from dplab.failures.hangs import SCENARIOS

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        "127.0.0.1",
        int(os.environ["MASTER_PORT"]),
        world_size + 1,
        False,
        timeout=timedelta(seconds=START_S),
    )
    timeout = timedelta(seconds=spec["timeout_s"])
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    start = time.perf_counter()
    error = None
    try:
        SCENARIOS[spec["scenario"]](spec["timeout_s"], **spec["params"])
    except RuntimeError as e:  # torch raises the timeout (and gloo's errors) as RuntimeError
        error = str(e)
    seconds = time.perf_counter() - start
    dump_flight_record(os.environ["TORCH_FR_DUMP_TEMP_FILE"] + str(rank))
    # Leave together: a rank that exits closes its sockets under a partner still waiting.
    store.set(f"done{rank}", "1")
    store.wait([f"done{r}" for r in range(world_size)], timedelta(seconds=START_S))
    print(RESULT_MARK + json.dumps({"error": error, "seconds": seconds}), flush=True)
    # No destroy_process_group: a group left with a timed-out collective can hang in teardown.
    os._exit(0)


if __name__ == "__main__":
    _rank_main(json.loads(sys.argv[1]))
