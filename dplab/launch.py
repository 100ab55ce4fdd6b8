"""Run N ranks from a notebook cell, a script, the CLI, or inside torchrun.

Why not ``torch.multiprocessing.spawn``? A function defined in a notebook cell lives in
``__main__``, and a spawned child cannot import the kernel's ``__main__``: the child fails with
"Can't get attribute ... on <module '__main__'>". So the function travels *by value*
(cloudpickle) to rank processes that we start ourselves with ``python -m dplab._worker``.

The rendezvous store lives in this (the calling) process, bound to 127.0.0.1 on a port the OS
picked, so two launches at once never collide and nothing listens on other interfaces. Gloo is
pinned to the loopback interface in the ranks for the same reason.

Inside torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and ``LOCAL_RANK``
set), ``launch`` runs ``fn`` in place on this process's rank and returns every rank's result
(gathered with ``all_gather_object``), so the same notebook code scales out unchanged. Some of
those variables without the others are leftovers of an earlier launcher, and an error: joining a
group nobody else will join would wait forever.

What each fault gives, and how fast, is in docs/reliability.md.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import itertools
import mmap
import multiprocessing.connection as mpc
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import types
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from multiprocessing import Pipe
from typing import Any

import cloudpickle

from dplab import _checks
from dplab.env import gpu_count, in_torchrun, pid_alive, resolve_backend, usable_cpus

__all__ = [
    "Cluster",
    "RankError",
    "RankTimeout",
    "check_capacity",
    "check_timeout",
    "check_world_size",
    "device",
    "gpu_count",
    "in_torchrun",
    "launch",
    "resolve_backend",
]

DEFAULT_TIMEOUT_S = 300.0
START_TIMEOUT_S = 120.0
# After one rank fails, how long the others get to finish before they are presumed stuck in a
# collective that will never complete and are stopped.
ERROR_GRACE_S = 2.0
# After a KeyboardInterrupt, how long the ranks get to finish the interrupted call before the
# pool is stopped (the stop button must answer within ~2 s).
INTERRUPT_GRACE_S = 1.0
# How often a wait wakes to look at the ranks' collective counts and at the clock.
POLL_S = 0.2
# Resident memory of one idle gloo rank (torch imported, process group joined), measured with
# /proc/PID/status VmRSS on torch 2.13 CPU: 229 MB (PSS 154 MB); see docs/reliability.md.
RANK_MEMORY_BYTES = 230e6
# More ranks than this per core is never a useful experiment on one machine, only a swap storm.
RANKS_PER_CORE = 16
LOG_PREFIX = "dplab-ranks-"
# The pipe protocol with dplab._worker: b"S" stops a rank; a call is CALL_HEADER + payload and
# its reply is (call id, "ok" | "error", body, collectives issued so far). Ids never repeat, so a
# reply left in a pipe can never be taken for a later call's.
CALL = b"C"
STOP = b"S"
CALL_HEADER = struct.Struct("<cQ")


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
    """Some ranks did not finish within ``timeout_s``; ``.ranks`` names them.

    ``.stacks`` holds, per stuck rank, where its Python code was when it was stopped.
    """

    def __init__(
        self, ranks: Sequence[int], timeout_s: float, *, stacks: dict[int, str] | None = None
    ):
        self.ranks = sorted(ranks)
        self.stacks = stacks or {}
        names = ", ".join(str(r) for r in self.ranks)
        msg = f"ranks {names} did not finish within timeout_s={timeout_s:g}; all ranks were stopped"
        for rank in self.ranks:
            if self.stacks.get(rank):
                msg += f"\nrank {rank} was stuck at (most recent call last):\n{self.stacks[rank]}"
        super().__init__(msg)


# ---------------------------------------------------------------------------------------------
# Checks shared by launch and Cluster


def check_world_size(world_size: Any) -> int:
    """A world size is a positive int (bools are not)."""
    return _checks.check_world_size(world_size)


def check_timeout(timeout_s: Any) -> float:
    """A finite number of seconds > 0: ``inf`` would overflow the waits after ``fn`` ran."""
    return _checks.check_positive("timeout_s", timeout_s)


def _available_memory() -> float | None:
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    with contextlib.suppress(AttributeError, ValueError, OSError):
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    return None


def check_capacity(world_size: int, *, oversubscribe: bool = False) -> int:
    """Refuse more ranks than this machine can hold, before starting any of them.

    Each rank is a process with torch in it (~230 MB): 10 000 of them would swap the machine to
    a halt long before the first collective. ``oversubscribe=True`` skips the check.
    """
    if oversubscribe:
        return world_size
    cores = usable_cpus()
    by_cores = RANKS_PER_CORE * cores
    memory = _available_memory()
    by_memory = None if memory is None else max(1, int(memory // RANK_MEMORY_BYTES))
    if world_size <= by_cores and (by_memory is None or world_size <= by_memory):
        return world_size
    reasons = [f"{cores} usable cores hold at most {by_cores} ranks ({RANKS_PER_CORE} per core)"]
    if by_memory is not None:
        reasons.append(
            f"{memory / 1e9:.1f} GB of available memory holds at most {by_memory} ranks of "
            f"~{RANK_MEMORY_BYTES / 1e6:.0f} MB each"
        )
    raise ValueError(
        f"world_size={world_size} is more ranks than this machine can hold: "
        + "; ".join(reasons)
        + ". Pass oversubscribe=True to start them anyway."
    )


def device() -> Any:
    """This rank's device: ``cuda:LOCAL_RANK`` under nccl, else the CPU.

    LOCAL_RANK is read whoever created the process group (dplab or the user, under torchrun), so
    every rank of a node gets its own GPU.
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", _local_rank())
    return torch.device("cpu")


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def _loopback_interface() -> str:
    """The loopback interface's name (``lo`` on Linux, ``lo0`` on macOS)."""
    with contextlib.suppress(OSError):
        names = [name for _, name in socket.if_nameindex()]
        for candidate in ("lo", "lo0"):
            if candidate in names:
                return candidate
    return "lo"


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


def _remove_stale_logdirs() -> None:
    """Remove the log folders of pools whose owner process is gone (killed, kernel restart)."""
    pattern = re.compile(re.escape(LOG_PREFIX) + r"(\d+)-")
    root = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            match = pattern.match(name)
            if match and not pid_alive(int(match[1])):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)


_STACK_LINE = re.compile(r'^\s+File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<name>\S+)')


def _main_thread_stack(dump: str) -> str:
    """The user's frames of the rank's main thread in a faulthandler dump, innermost last."""
    for block in dump.split("\n\n"):
        frames = [m for line in block.splitlines() if (m := _STACK_LINE.match(line))]
        names = [m["name"] for m in frames]
        if "main" in names and "_run" in names:
            user = frames[: names.index("_run")]  # faulthandler lists the innermost first
            return "\n".join(
                f'  File "{m["file"]}", line {m["line"]}, in {m["name"]}' for m in reversed(user)
            )
    return ""


# ---------------------------------------------------------------------------------------------
# Notebook hygiene: IPython's output history keeps a displayed Cluster alive


_LIVE: weakref.WeakSet[Cluster] = weakref.WeakSet()
_HISTORY_NAME = re.compile(r"_+|_\d+")


def _ipython_shell() -> Any:
    if "IPython" not in sys.modules:
        return None
    with contextlib.suppress(Exception):
        from IPython import get_ipython

        return get_ipython()
    return None


def _held_only_by_history(cluster: Cluster, shell: Any) -> bool:
    """True when nothing but IPython's ``Out``/``_``/``_N`` history refers to ``cluster``.

    Re-running ``c = Cluster(2); c`` rebinds ``c``, but ``Out[n]`` still holds the old pool, so
    its ranks would live until the kernel dies. A pool the user can only reach through the
    output history is one they have let go of.
    """
    from IPython.core.displayhook import DisplayHook

    ns = shell.user_ns
    out = ns.get("Out")
    # Cheap tests first: a full referrer scan walks the whole heap, so it is done only for a
    # pool that was displayed and is no longer named in the namespace.
    # (Loops, not comprehensions: a comprehension's closure cell would be one more referrer.)
    if not isinstance(out, dict) or cluster not in _values_by_identity(out):
        return False
    for key, value in ns.items():
        if value is cluster and not (isinstance(key, str) and _HISTORY_NAME.fullmatch(key)):
            return False
    history = {id(out), id(getattr(shell.history_manager, "output_hist", None))}
    for ref in gc.get_referrers(cluster):
        if isinstance(ref, types.FrameType | DisplayHook) or id(ref) in history:
            continue  # our own frame; the display hook's _, __, ___; Out
        if type(ref).__name__ == "ExecutionResult":
            continue
        if isinstance(ref, dict) and _only_history_names(ref, cluster):
            continue  # the namespace, or a copy of its _, _N entries
        return False
    return True


def _values_by_identity(mapping: dict) -> list[object]:
    found = []
    for value in mapping.values():
        if isinstance(value, Cluster):
            found.append(value)
    return found


def _only_history_names(namespace: dict, obj: object) -> bool:
    names = []
    for key, value in namespace.items():  # a loop, not a comprehension: no closure cell
        if value is obj:
            names.append(key)
    return bool(names) and all(isinstance(k, str) and _HISTORY_NAME.fullmatch(k) for k in names)


def _close_pools_left_in_history(*_: object) -> None:
    """After each cell: close the pools that only the output history still holds."""
    shell = _ipython_shell()
    if shell is None:
        return
    for ref in list(_LIVE.data):
        cluster = ref()
        if cluster is not None and cluster._procs and _held_only_by_history(cluster, shell):
            cluster.close()
        del cluster


def _watch_ipython_history() -> None:
    """In IPython, check after every cell (``c = Cluster(2)`` rebinds ``c`` only after the new
    pool exists, so the old one can be let go of only once the cell is done)."""
    shell = _ipython_shell()
    if shell is None or getattr(shell, "_dplab_watches_history", False):
        return
    with contextlib.suppress(Exception):
        shell.events.register("post_run_cell", _close_pools_left_in_history)
        shell._dplab_watches_history = True


@atexit.register
def _stop_all_pools() -> None:
    for ref in list(_LIVE.data):
        cluster = ref()
        if cluster is not None:
            with contextlib.suppress(Exception):
                cluster._stop(force=True)


# ---------------------------------------------------------------------------------------------
# The warm pool


class Cluster:
    """A warm pool of rank processes that outlives a cell.

    ``with dplab.Cluster(2) as c: c.run(fn, *args)`` returns ``fn``'s results indexed by rank,
    like :func:`launch`, but the processes, ``import torch`` and the process group are paid for
    once. A widget can then re-measure in well under a second.

    A rank that fails raises :class:`RankError`. If the other ranks finish, the pool stays
    usable; if they are stuck (say, in a collective the failed rank never joined), every rank is
    stopped and the pool says so until :meth:`restart`. A rank that dies between runs is found
    by the next run (a RankError naming it), and ``alive`` says so at once.
    """

    def __init__(
        self,
        world_size: int,
        *,
        backend: str = "auto",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        env: dict[str, str] | None = None,
        oversubscribe: bool = False,
    ):
        self.world_size = check_capacity(check_world_size(world_size), oversubscribe=oversubscribe)
        self.timeout_s = check_timeout(timeout_s)
        self.backend = resolve_backend(backend, self.world_size)
        self._extra_env = dict(env or {})
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Any] = []
        self._lifelines: list[int] = []
        self._logs: list[io.BufferedReader] = []
        self._logdir: str | None = None
        self._counts: Any = None
        self._store = None
        self._call_ids = itertools.count(1)
        self.dead_reason: str | None = "not started"
        _watch_ipython_history()
        _LIVE.add(self)
        self._start()

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """Started, not stopped, and every rank process still running."""
        return self.dead_reason is None and all(p.poll() is None for p in self._procs)

    def _start(self) -> None:
        import torch.distributed as dist

        _remove_stale_logdirs()
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
        # The owner's pid is in the name, so a later pool can remove a folder whose owner died.
        self._logdir = tempfile.mkdtemp(prefix=f"{LOG_PREFIX}{os.getpid()}-")
        counts_path = os.path.join(self._logdir, "collectives")
        with open(counts_path, "wb") as f:
            f.write(bytes(8 * self.world_size))
        with open(counts_path, "r+b") as f:
            self._counts = memoryview(mmap.mmap(f.fileno(), 8 * self.world_size)).cast("q")
        threads = max(1, usable_cpus() // self.world_size)
        base_env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
        base_env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            WORLD_SIZE=str(self.world_size),
            LOCAL_WORLD_SIZE=str(self.world_size),
            DPLAB_BACKEND=self.backend,
            DPLAB_PARENT_PID=str(os.getpid()),
            DPLAB_LOGDIR=self._logdir,
            DPLAB_COUNTS=counts_path,
            OMP_NUM_THREADS=str(threads),
            GLOO_SOCKET_IFNAME=_loopback_interface(),
            PYTHONUNBUFFERED="1",
        )
        base_env.update(self._extra_env)
        try:
            for rank in range(self.world_size):
                parent_end, child_end = Pipe(duplex=True)
                life_read, life_write = os.pipe()
                log_path = os.path.join(self._logdir, f"rank{rank}.log")
                try:
                    with open(log_path, "wb") as log:
                        env = dict(base_env, RANK=str(rank), LOCAL_RANK=str(rank))
                        fds = [child_end.fileno(), life_read]
                        proc = subprocess.Popen(
                            [sys.executable, "-m", "dplab._worker", *map(str, fds)],
                            pass_fds=fds,
                            env=env,
                            stdin=subprocess.DEVNULL,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            cwd=os.getcwd(),
                        )
                finally:
                    child_end.close()
                    os.close(life_read)
                self._procs.append(proc)
                self._conns.append(parent_end)
                self._lifelines.append(life_write)
                self._logs.append(open(log_path, "rb"))  # noqa: SIM115 (kept open to tail)
            self._collect(0, START_TIMEOUT_S, what="start")
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
        if self.dead_reason is None and not self.alive:
            died = self._first_dead_rank()
            state = f"rank {died} {self._exit_of(died)}: call .restart()"
        else:
            state = "alive" if self.alive else f"stopped ({self.dead_reason})"
        return f"Cluster(world_size={self.world_size}, backend={self.backend!r}, {state})"

    def _stop(self, *, force: bool) -> None:
        if not force:
            for conn in self._conns:
                with contextlib.suppress(OSError, ValueError):
                    conn.send_bytes(STOP)
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
        for fd in self._lifelines:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._procs, self._conns, self._logs, self._lifelines = [], [], [], []
        self._store = None
        self._counts = None  # the mapping goes with the last reference
        if self._logdir is not None:
            shutil.rmtree(self._logdir, ignore_errors=True)
            self._logdir = None

    def _first_dead_rank(self) -> int | None:
        return next((r for r, p in enumerate(self._procs) if p.poll() is not None), None)

    def _exit_of(self, rank: int | None) -> str:
        return "" if rank is None else _describe_exit(self._procs[rank].poll())

    def _fail_dead_rank(self, rank: int, when: str) -> RankError:
        """Stop the pool because ``rank`` died ``when``; the error to raise."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._procs[rank].wait(timeout=5)
        detail = f"the rank process {self._exit_of(rank)} {when}{self._log_tail(rank)}"
        self._stop(force=True)
        self.dead_reason = f"rank {rank} {_describe_exit_short(detail)}; call .restart()"
        return RankError(
            rank, detail + "\nall ranks were stopped; call .restart() for a fresh pool"
        )

    # -- running --------------------------------------------------------------------------------

    def run(self, fn: Callable, *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results indexed by rank."""
        if self.dead_reason is not None:
            raise RuntimeError(
                f"this Cluster is stopped ({self.dead_reason}); call .restart() for a fresh one"
            )
        payload = _pickle_call(fn, args, kwargs)
        died = self._first_dead_rank()
        if died is not None:
            raise self._fail_dead_rank(died, "while the pool was idle (between runs)")
        call_id = next(self._call_ids)
        message = CALL_HEADER.pack(CALL, call_id) + payload
        self._pending = set(range(self.world_size))
        sent = False
        try:
            for rank, conn in enumerate(self._conns):
                try:
                    conn.send_bytes(message)
                except OSError:
                    raise self._fail_dead_rank(rank, "before it received the call") from None
            sent = True
            return self._collect(call_id, self.timeout_s, what="run")
        except KeyboardInterrupt:
            self._interrupted(call_id, sent=sent)
            raise

    def _interrupted(self, call_id: int, *, sent: bool) -> None:
        """After Ctrl-C: let the ranks finish the call briefly, else stop them (never hang).

        Interrupted while sending, a pipe may hold half a message: the pool is stopped.
        """
        pending = set(self._pending) if sent else {-1}
        deadline = time.monotonic() + INTERRUPT_GRACE_S
        try:
            while sent and pending and self._procs:
                ready = mpc.wait(
                    [self._conns[r] for r in pending], max(0.0, deadline - time.monotonic())
                )
                if not ready:
                    break
                for conn in ready:
                    rank = self._conns.index(conn)
                    try:
                        if conn.recv()[0] == call_id:
                            pending.discard(rank)
                    except (EOFError, OSError):
                        break
        except (KeyboardInterrupt, OSError, ValueError):
            pass
        if pending or not self.alive:
            self._stop(force=True)
            self.dead_reason = (
                "a KeyboardInterrupt stopped a run while ranks were inside it; "
                "their state is unknown, so all ranks were stopped"
            )

    def _collect(self, call_id: int, timeout_s: float, *, what: str) -> list[Any]:
        """Wait for one reply per rank to ``call_id``; errors get a grace period, then stuck
        ranks die. A rank that returns while another has issued a collective it never issued
        means the ranks can never meet: they are stopped at once."""
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        returned_counts: dict[int, int] = {}  # collectives issued by the ranks that returned
        ok_counts: dict[int, int] = {}
        pending = set(range(self.world_size))
        self._pending = pending
        deadline = time.monotonic() + timeout_s
        grace_end: float | None = None
        while pending:
            end = deadline if grace_end is None else min(deadline, grace_end)
            now = time.monotonic()
            if now >= end:
                break
            waiting = [self._conns[r] for r in pending]
            for conn in mpc.wait(waiting, timeout=min(POLL_S, end - now)):
                rank = self._conns.index(conn)
                try:
                    reply_id, kind, body, count = conn.recv()
                except (EOFError, OSError):
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        self._procs[rank].wait(timeout=5)
                    reply_id, kind, count = call_id, "error", None
                    body = (
                        f"the rank process {self._exit_of(rank)} during {what}"
                        f"{self._log_tail(rank)}"
                    )
                if reply_id != call_id:
                    continue  # the reply to an earlier, abandoned call: never this call's
                pending.discard(rank)
                if count is not None:
                    returned_counts[rank] = count
                if kind == "ok":
                    try:
                        results[rank] = cloudpickle.loads(body)
                    except Exception as e:
                        kind, body = (
                            "error",
                            (
                                f"rank {rank} returned a value that cannot be unpickled in the "
                                f"caller: {e!r}. Return plain types (numbers, lists, dicts, "
                                "tensors) or classes the caller can import."
                            ),
                        )
                if kind == "ok" and count is not None:
                    ok_counts[rank] = count
                if kind != "ok":
                    errors[rank] = body
                    if grace_end is None:
                        grace_end = time.monotonic() + ERROR_GRACE_S
            if what == "run" and pending and ok_counts and not errors:
                self._check_desync(ok_counts, pending)
        self._relay_output()
        if what == "run" and not pending and len(set(returned_counts.values())) > 1:
            self._stop(force=True)
            self.dead_reason = (
                "the ranks issued different numbers of collectives "
                f"({_counts_text(returned_counts)}): their next collectives would pair with "
                "the wrong partners"
            )
            if not errors:
                raise RankError(
                    max(returned_counts, key=returned_counts.__getitem__),
                    f"the ranks issued different collectives ({_counts_text(returned_counts)} "
                    "on the default group); all ranks were stopped, call .restart()",
                )
        if errors:
            first = next(iter(errors))
            died = [r for r, p in enumerate(self._procs) if p.poll() is not None]
            if self._procs and (pending or died or what == "start"):
                self._stop(force=True)
                self.dead_reason = f"rank {first} failed during {what}; all ranks were stopped"
            others = {r: tb for r, tb in errors.items() if r != first}
            raise RankError(first, errors[first], others=others)
        if pending:
            stacks = self._stacks(pending) if what == "run" else {}
            self._stop(force=True)
            self.dead_reason = f"ranks {sorted(pending)} timed out during {what}"
            raise RankTimeout(sorted(pending), timeout_s, stacks=stacks)
        return [results[r] for r in range(self.world_size)]

    def _check_desync(self, returned: dict[int, int], pending: set[int]) -> None:
        """Rank p issued more collectives than rank r, which has returned: p waits forever."""
        done = min(returned, key=returned.__getitem__)
        for stuck in sorted(pending):
            issued = self._counts[stuck]
            if issued > returned[done]:
                where = self._stacks({stuck}).get(stuck, "")
                self._stop(force=True)
                self.dead_reason = f"rank {done} and rank {stuck} issued different collectives"
                msg = (
                    f"rank {done} returned while rank {stuck} is still inside a collective: "
                    f"the ranks issued different collectives (rank {stuck} has issued "
                    f"{issued} on the default group, rank {done} returned after "
                    f"{returned[done]}). All ranks were stopped; call .restart()."
                )
                if where:
                    msg += f"\nrank {stuck} was at (most recent call last):\n{where}"
                raise RankError(stuck, msg)

    def _stacks(self, ranks: set[int]) -> dict[int, str]:
        """Where each of ``ranks`` is now: faulthandler dumps its threads into its log."""
        if self._logdir is None:
            return {}
        self._relay_output()  # what the ranks printed so far; the dumps themselves are not shown
        sizes = {}
        for rank in ranks:
            path = os.path.join(self._logdir, f"rank{rank}.log")
            with contextlib.suppress(OSError):
                sizes[rank] = os.path.getsize(path)
                os.kill(self._procs[rank].pid, signal.SIGUSR1)
        out: dict[int, str] = {}
        deadline = time.monotonic() + 1.0
        while sizes and time.monotonic() < deadline:
            time.sleep(0.05)
            for rank in list(sizes):
                with contextlib.suppress(OSError):
                    with open(os.path.join(self._logdir, f"rank{rank}.log"), "rb") as f:
                        f.seek(sizes[rank])
                        dump = f.read().decode(errors="replace")
                    stack = _main_thread_stack(dump)
                    if stack:
                        out[rank] = stack
                        del sizes[rank]
        time.sleep(0.05)  # the dump's last lines
        for rank in ranks:
            with contextlib.suppress(OSError, ValueError, IndexError):
                self._logs[rank].seek(0, os.SEEK_END)
        return out

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


def _describe_exit_short(detail: str) -> str:
    return detail.split(";", 1)[0].removeprefix("the rank process ")


def _counts_text(counts: dict[int, int]) -> str:
    return ", ".join(f"rank {r}: {n}" for r, n in sorted(counts.items()))


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
    oversubscribe: bool = False,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh ranks; return results by rank.

    Each rank has ``torch.distributed`` initialised (gloo or nccl) before ``fn`` runs; under nccl
    rank r owns ``cuda:r`` (see :func:`device`). Under torchrun the call runs ``fn`` in place on
    this process's rank and returns the list of all ranks' results.
    """
    check_world_size(world_size)
    timeout_s = check_timeout(timeout_s)
    if in_torchrun():
        return _run_in_place(fn, world_size, backend, tuple(args), dict(kwargs or {}), timeout_s)
    check_capacity(world_size, oversubscribe=oversubscribe)
    _pickle_call(fn, tuple(args), kwargs)  # fail fast, before paying for processes
    with Cluster(world_size, backend=backend, timeout_s=timeout_s, oversubscribe=True) as cluster:
        return cluster.run(fn, *args, **(kwargs or {}))


LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


def check_launcher_env(world_size: int) -> None:
    """The env:// variables describe a launcher that is really there, with our world size.

    RANK, WORLD_SIZE and MASTER_ADDR alone are what an earlier torchrun (or a copied
    ``%env``) leaves behind; trusting them, rank 0 would wait for ranks that never come.
    """
    env = os.environ
    present = [k for k in LAUNCHER_VARIABLES if k in env]
    missing = [k for k in LAUNCHER_VARIABLES if k not in env]
    shown = ", ".join(f"{k}={env[k]}" for k in present)
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise RuntimeError(
            f"{shown} are set, as a launcher like torchrun sets them, but {', '.join(missing)} "
            f"{verb} not: these look like variables left over from an earlier launcher, not a "
            "launcher running this process. Remove them (for k in "
            f"{tuple(present)!r}: os.environ.pop(k)) so dplab.launch starts its own ranks, "
            "or run this under torchrun."
        )
    try:
        rank, env_world, port = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["MASTER_PORT"])
        int(env["LOCAL_RANK"])
    except ValueError:
        raise RuntimeError(f"the launcher's variables are not all integers: {shown}") from None
    if env_world != world_size:
        raise ValueError(
            f"world_size={world_size} but this process runs under a launcher with "
            f"WORLD_SIZE={env_world}"
        )
    if not 0 <= rank < env_world or not 0 < port < 65536:
        raise RuntimeError(f"the launcher's variables do not fit together: {shown}")


def _join_launcher_group(backend: str, timeout_s: float) -> None:
    """init_process_group for the launcher's rank, within timeout_s, never on 0.0.0.0."""
    import torch.distributed as dist

    env = os.environ
    timeout = timedelta(seconds=timeout_s)
    if env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        # torchrun's agent hosts the store: every rank is a client, nothing listens here.
        dist.init_process_group(backend, timeout=timeout)
        atexit.register(_leave_launcher_group)
        return
    rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
    addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    kwargs: dict[str, Any] = {}
    if rank == 0:
        # Bind MASTER_ADDR only; TCPStore's own bind would listen on every interface.
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((addr, port))
            listener.listen(128)
        except OSError as e:
            listener.close()
            raise RuntimeError(
                f"rank 0 cannot listen on MASTER_ADDR={addr}:{port} for the other ranks: {e}"
            ) from None
        kwargs["master_listen_fd"] = listener.detach()
    try:
        store = dist.TCPStore(addr, port, world_size, rank == 0, timeout=timeout, **kwargs)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )
    except RuntimeError as e:  # DistStoreError (a timeout) is one
        raise RuntimeError(
            f"rank {rank} could not join the launcher's group of WORLD_SIZE={world_size} at "
            f"MASTER_ADDR={addr}:{port} within timeout_s={timeout_s:g}: {str(e).splitlines()[0]}"
            ". Are the other ranks running?"
        ) from None
    atexit.register(_leave_launcher_group)


def _leave_launcher_group() -> None:
    """Destroy the group dplab created, at exit, as torch asks of every program that made one.

    torch warns when a group is left to the interpreter's teardown (NCCL's most loudly), and a
    group destroyed here is one the next ``init_process_group`` in the same process can replace.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _run_in_place(
    fn: Callable,
    world_size: int,
    backend: str,
    args: tuple,
    kwargs: dict,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list:
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise ValueError(
                f"world_size={world_size} but this process's group has "
                f"world size {dist.get_world_size()}"
            )
    else:
        check_launcher_env(world_size)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        backend = resolve_backend(backend, local_world)
        if backend == "nccl":
            torch.cuda.set_device(_local_rank())
        _join_launcher_group(backend, timeout_s)
    if dist.get_backend() == "nccl" and gpu_count() > _local_rank():
        # A group the user created first may have left every rank on cuda:0.
        torch.cuda.set_device(_local_rank())
    result = fn(*args, **kwargs)
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, result)
    # gloo's worker thread lets go of the gathered tensors only after wait() has returned, and
    # that needs the GIL; a rank that went straight on to exit could reach the interpreter's
    # finalization first, and the thread then aborted the process ("terminate called without an
    # active exception"). Waiting in a barrier hands the GIL over until every rank is here.
    dist.barrier()
    return gathered
