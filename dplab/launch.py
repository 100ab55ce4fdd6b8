"""Run N ranks from a notebook cell, a script, the CLI, or inside torchrun.

Why not ``torch.multiprocessing.spawn``? A function defined in a notebook cell lives in
``__main__``, and a spawned child cannot import the kernel's ``__main__``: the child fails with
"Can't get attribute ... on <module '__main__'>". So the function travels *by value*
(cloudpickle) to rank processes that we start ourselves with ``python -m dplab._worker``.

The rendezvous store lives in this (the calling) process, bound to 127.0.0.1 on a port the OS
picked, so two launches at once never collide and nothing listens on other interfaces. Gloo is
pinned to the loopback interface in the ranks for the same reason.

Inside torchrun (``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR`` set), ``launch`` runs ``fn`` in
place on this process's rank and returns every rank's result (gathered with
``all_gather_object``), so the same notebook code scales out unchanged.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing.connection as mpc
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from multiprocessing import Pipe
from typing import Any

import cloudpickle

DEFAULT_TIMEOUT_S = 300.0
START_TIMEOUT_S = 120.0
# After one rank fails, how long the others get to finish before they are presumed stuck in a
# collective that will never complete and are stopped.
ERROR_GRACE_S = 2.0


class RankError(RuntimeError):
    """A rank raised or died. ``.rank`` is the rank; the message holds its traceback."""

    def __init__(self, rank: int, traceback: str, *, others: dict[int, str] | None = None):
        self.rank = rank
        self.traceback = traceback
        self.others = others or {}
        msg = f"rank {rank} failed:\n{traceback.rstrip()}"
        if self.others:
            msg += "\n(also failed: " + ", ".join(f"rank {r}" for r in sorted(self.others)) + ")"
        super().__init__(msg)


class RankTimeout(TimeoutError):
    """Some ranks did not finish within ``timeout_s``; ``.ranks`` names them."""

    def __init__(self, ranks: Sequence[int], timeout_s: float):
        self.ranks = sorted(ranks)
        names = ", ".join(str(r) for r in self.ranks)
        super().__init__(
            f"ranks {names} did not finish within timeout_s={timeout_s:g}; all ranks were stopped"
        )


# ---------------------------------------------------------------------------------------------
# Checks shared by launch and Cluster


def check_world_size(world_size: Any) -> int:
    """A world size is a positive int (bools are not)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    return world_size


def gpu_count() -> int:
    """GPUs torch can see, without creating a CUDA context in this process."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_backend(backend: str, world_size: int, *, gpus: int | None = None) -> str:
    """``auto`` → nccl when there is one GPU per rank, else gloo; check an explicit choice.

    NCCL refuses two ranks on one GPU, so nccl with fewer GPUs than ranks is an error here rather
    than a hang later.
    """
    import torch.distributed as dist

    gpus = gpu_count() if gpus is None else gpus
    if backend == "auto":
        return "nccl" if gpus >= world_size and dist.is_nccl_available() else "gloo"
    if backend == "gloo":
        if not dist.is_gloo_available():
            raise RuntimeError("this torch build has no gloo backend")
        return backend
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise ValueError("backend='nccl' but this torch build has no NCCL (a CPU build?)")
        if gpus < world_size:
            raise ValueError(
                f"backend='nccl' needs one CUDA GPU per rank: world_size={world_size} but "
                f"{gpus} GPU(s) visible. NCCL cannot put two ranks on one GPU; use "
                "backend='gloo' (CPU tensors, or CUDA tensors on a shared GPU)."
            )
        return backend
    raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")


def in_torchrun() -> bool:
    """True inside torchrun (or any launcher that sets the env:// variables)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def device() -> Any:
    """This rank's device: ``cuda:LOCAL_RANK`` under nccl, else the CPU."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _loopback_interface() -> str:
    """The loopback interface's name (``lo`` on Linux, ``lo0`` on macOS)."""
    with contextlib.suppress(OSError):
        names = [name for _, name in socket.if_nameindex()]
        for candidate in ("lo", "lo0"):
            if candidate in names:
                return candidate
    return "lo"


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _source_map(fn: Callable) -> dict[str, tuple[str, list[str]]]:
    """Where ``fn`` and the functions it calls by name came from, with their source lines.

    cloudpickle ships functions from ``__main__`` without their file name, so a rank's
    traceback would only say ``<dynamic-code>``; with this map the rank names the cell or file
    and quotes the failing line.
    """
    import linecache

    out: dict[str, tuple[str, list[str]]] = {}
    code = getattr(fn, "__code__", None)
    if code is None:
        return out
    found = [fn] + [
        g
        for name in code.co_names
        if callable(g := getattr(fn, "__globals__", {}).get(name)) and hasattr(g, "__code__")
    ]
    for f in found:
        filename = f.__code__.co_filename
        out[f.__code__.co_name] = (filename, linecache.getlines(filename))
    return out


def _pickle_call(fn: Callable, args: tuple, kwargs: dict | None) -> bytes:
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {fn!r}")
    try:
        call = cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))
    except Exception as e:
        name = getattr(fn, "__qualname__", repr(fn))
        raise TypeError(
            f"cannot send {name} and its arguments to the ranks: they cannot be pickled ({e})"
        ) from e
    # The call is unpickled only after the rank has this process's sys.path, so functions
    # from modules found through it (a script's folder, a benchmark's helpers) import there.
    return cloudpickle.dumps((list(sys.path), _source_map(fn), call))


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


# ---------------------------------------------------------------------------------------------
# The warm pool


class Cluster:
    """A warm pool of rank processes that outlives a cell.

    ``with dplab.Cluster(2) as c: c.run(fn, *args)`` returns ``fn``'s results indexed by rank,
    like :func:`launch`, but the processes, ``import torch`` and the process group are paid for
    once. A widget can then re-measure in well under a second.

    A rank that fails raises :class:`RankError`. If the other ranks finish, the pool stays
    usable; if they are stuck (say, in a collective the failed rank never joined), every rank is
    stopped and the pool says so until :meth:`restart`.
    """

    def __init__(
        self,
        world_size: int,
        *,
        backend: str = "auto",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        env: dict[str, str] | None = None,
    ):
        self.world_size = check_world_size(world_size)
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.backend = resolve_backend(backend, self.world_size)
        self.timeout_s = float(timeout_s)
        self._extra_env = dict(env or {})
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Any] = []
        self._logs: list[io.BufferedReader] = []
        self._logdir: str | None = None
        self._store = None
        self.dead_reason: str | None = "not started"
        self._start()

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self.dead_reason is None

    def _start(self) -> None:
        import torch.distributed as dist

        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        port = listener.getsockname()[1]
        # The store takes the bound socket (and closes it when it goes), so it listens on
        # 127.0.0.1 only; TCPStore's own bind would listen on every interface.
        self._store = dist.TCPStore(
            "127.0.0.1",
            port,
            self.world_size + 1,
            True,
            timeout=timedelta(seconds=START_TIMEOUT_S),
            wait_for_workers=False,
            master_listen_fd=listener.detach(),
        )
        self._logdir = tempfile.mkdtemp(prefix="dplab-ranks-")
        threads = max(1, _usable_cpus() // self.world_size)
        base_env = dict(os.environ)
        base_env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            WORLD_SIZE=str(self.world_size),
            LOCAL_WORLD_SIZE=str(self.world_size),
            DPLAB_BACKEND=self.backend,
            DPLAB_PARENT_PID=str(os.getpid()),
            OMP_NUM_THREADS=str(threads),
            GLOO_SOCKET_IFNAME=_loopback_interface(),
            PYTHONUNBUFFERED="1",
        )
        base_env.update(self._extra_env)
        try:
            for rank in range(self.world_size):
                parent_end, child_end = Pipe(duplex=True)
                log_path = os.path.join(self._logdir, f"rank{rank}.log")
                with open(log_path, "wb") as log:
                    env = dict(base_env, RANK=str(rank), LOCAL_RANK=str(rank))
                    proc = subprocess.Popen(
                        [sys.executable, "-m", "dplab._worker", str(child_end.fileno())],
                        pass_fds=[child_end.fileno()],
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        cwd=os.getcwd(),
                    )
                child_end.close()
                self._procs.append(proc)
                self._conns.append(parent_end)
                self._logs.append(open(log_path, "rb"))  # noqa: SIM115 (kept open to tail)
            self._collect(START_TIMEOUT_S, what="start")
        except BaseException:
            self._stop(force=True)
            raise
        self.dead_reason = None

    def restart(self) -> Cluster:
        """Stop every rank and start a fresh pool (after a failure, or to clear state)."""
        self._stop(force=True)
        self._start()
        return self

    def close(self) -> None:
        """Ask every rank to leave its process group and exit; kill those that do not."""
        self._stop(force=not self.alive)
        self.dead_reason = "closed"

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._stop(force=True)

    def __repr__(self) -> str:
        state = "alive" if self.alive else f"stopped ({self.dead_reason})"
        return f"Cluster(world_size={self.world_size}, backend={self.backend!r}, {state})"

    def _stop(self, *, force: bool) -> None:
        if not force:
            for conn in self._conns:
                with contextlib.suppress(OSError, ValueError):
                    conn.send_bytes(b"S")
        deadline = time.monotonic() + (0.0 if force else 10.0)
        for proc in self._procs:
            if proc.poll() is None and not force:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self._relay_output()
        for handle in [*self._conns, *self._logs]:
            with contextlib.suppress(OSError):
                handle.close()
        self._procs, self._conns, self._logs = [], [], []
        self._store = None
        if self._logdir is not None:
            shutil.rmtree(self._logdir, ignore_errors=True)
            self._logdir = None

    # -- running --------------------------------------------------------------------------------

    def run(self, fn: Callable, *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results indexed by rank."""
        if not self.alive:
            raise RuntimeError(
                f"this Cluster is stopped ({self.dead_reason}); call .restart() for a fresh one"
            )
        payload = _pickle_call(fn, args, kwargs)
        for conn in self._conns:
            conn.send_bytes(payload)
        return self._collect(self.timeout_s, what="run")

    def _collect(self, timeout_s: float, *, what: str) -> list[Any]:
        """Wait for one message per rank. Errors get a grace period, then stuck ranks die."""
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        pending = set(range(self.world_size))
        deadline = time.monotonic() + timeout_s
        grace_end: float | None = None
        while pending:
            end = deadline if grace_end is None else min(deadline, grace_end)
            waiting = [self._conns[r] for r in pending]
            ready = mpc.wait(waiting, timeout=max(0.0, end - time.monotonic()))
            if not ready:
                break
            for conn in ready:
                rank = self._conns.index(conn)
                pending.discard(rank)
                try:
                    kind, body = conn.recv()
                except (EOFError, OSError):
                    self._procs[rank].wait(timeout=5)
                    kind, body = (
                        "error",
                        (
                            f"the rank process {_describe_exit(self._procs[rank].returncode)}"
                            f"{self._log_tail(rank)}"
                        ),
                    )
                if kind == "ok":
                    results[rank] = cloudpickle.loads(body)
                else:
                    errors[rank] = body
                    if grace_end is None:
                        grace_end = time.monotonic() + ERROR_GRACE_S
        self._relay_output()
        if errors:
            first = next(iter(errors))
            died = [r for r, p in enumerate(self._procs) if p.poll() is not None]
            if pending or died or what == "start":
                self._stop(force=True)
                self.dead_reason = f"rank {first} failed during {what}; all ranks were stopped"
            others = {r: tb for r, tb in errors.items() if r != first}
            raise RankError(first, errors[first], others=others)
        if pending:
            self._stop(force=True)
            self.dead_reason = f"ranks {sorted(pending)} timed out during {what}"
            raise RankTimeout(sorted(pending), timeout_s)
        return [results[r] for r in range(self.world_size)]

    # -- rank output ----------------------------------------------------------------------------

    def _relay_output(self) -> None:
        """Show what ranks printed, prefixed by rank (ranks should return values, not print)."""
        for rank, log in enumerate(self._logs):
            with contextlib.suppress(OSError, ValueError):
                text = log.read().decode(errors="replace")
                for line in text.splitlines():
                    print(f"[rank {rank}] {line}", file=sys.stderr)

    def _log_tail(self, rank: int, lines: int = 30) -> str:
        if self._logdir is None:
            return ""
        with contextlib.suppress(OSError):
            path = os.path.join(self._logdir, f"rank{rank}.log")
            with open(path, "rb") as f:
                tail = f.read().decode(errors="replace").splitlines()[-lines:]
            if tail:
                return "; its last output:\n" + "\n".join(tail)
        return ""


# ---------------------------------------------------------------------------------------------
# One-shot launch


def launch(
    fn: Callable,
    world_size: int,
    *,
    backend: str = "auto",
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh ranks; return results by rank.

    Each rank has ``torch.distributed`` initialised (gloo or nccl) before ``fn`` runs; under nccl
    rank r owns ``cuda:r`` (see :func:`device`). Under torchrun the call runs ``fn`` in place on
    this process's rank and returns the list of all ranks' results.
    """
    check_world_size(world_size)
    if in_torchrun():
        return _run_in_place(fn, world_size, backend, tuple(args), dict(kwargs or {}))
    _pickle_call(fn, tuple(args), kwargs)  # fail fast, before paying for processes
    with Cluster(world_size, backend=backend, timeout_s=timeout_s) as cluster:
        return cluster.run(fn, *args, **(kwargs or {}))


def _run_in_place(fn: Callable, world_size: int, backend: str, args: tuple, kwargs: dict) -> list:
    import torch
    import torch.distributed as dist

    env_world = int(os.environ["WORLD_SIZE"])
    if world_size != env_world:
        raise ValueError(
            f"world_size={world_size} but this process runs under a launcher with "
            f"WORLD_SIZE={env_world}"
        )
    if not dist.is_initialized():
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", env_world))
        chosen = resolve_backend(backend, local_world)
        if chosen == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(chosen)
    result = fn(*args, **kwargs)
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, result)
    return gathered
