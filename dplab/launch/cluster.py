"""The warm pool: rank processes that outlive a cell, each running the calls the caller sends.

The rendezvous store lives in this (the calling) process, bound to 127.0.0.1 on a port the OS
picked, so two pools at once never collide and nothing listens on other interfaces. Gloo is
pinned to the loopback interface in the ranks for the same reason.

The ranks run in a process group of their own: JupyterLab's stop button sends SIGINT to the
kernel's whole process group, and ranks in it died idle in ``recv_bytes()``. The interrupt is
the caller's: it stops a run it interrupts (see :meth:`Cluster._interrupted`), and an interrupt
of an unrelated cell leaves the pool alive.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import itertools
import mmap
import multiprocessing.connection as mpc
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing import Pipe
from typing import Any

import cloudpickle

from dplab.env import pid_alive, resolve_backend, usable_cpus
from dplab.launch.capacity import check_capacity, check_timeout, check_world_size
from dplab.launch.collect import Replies
from dplab.launch.errors import RankError, RankTimeout
from dplab.launch.history import LIVE, watch_ipython_history
from dplab.launch.output import RankOutput
from dplab.launch.protocol import CALL, CALL_HEADER, STOP, Reply, pickle_call
from dplab.launch.torchrun import DEFAULT_TIMEOUT_S

START_TIMEOUT_S = 120.0
# After a KeyboardInterrupt, how long the ranks get to finish the interrupted call before the
# pool is stopped (the stop button must answer within ~2 s).
INTERRUPT_GRACE_S = 1.0
LOG_PREFIX = "dplab-ranks-"


def _loopback_interface() -> str:
    """The loopback interface's name (``lo`` on Linux, ``lo0`` on macOS)."""
    with contextlib.suppress(OSError):
        names = [name for _, name in socket.if_nameindex()]
        for candidate in ("lo", "lo0"):
            if candidate in names:
                return candidate
    return "lo"


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _takes_keyword(fn: Callable, name: str) -> bool:
    """Whether ``fn`` accepts ``name=`` (true when its signature cannot be read)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(
        p.kind is p.VAR_KEYWORD
        or (p.name == name and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))
        for p in params
    )


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


def _describe_exit_short(detail: str) -> str:
    return detail.split(";", 1)[0].removeprefix("the rank process ")


def _counts_text(counts: dict[int, int]) -> str:
    return ", ".join(f"rank {r}: {n}" for r, n in sorted(counts.items()))


@atexit.register
def _stop_all_pools() -> None:
    for ref in list(LIVE.data):
        cluster = ref()
        if cluster is not None:
            with contextlib.suppress(Exception):
                cluster._stop(force=True)


class Cluster:
    """A warm pool of rank processes that outlives a cell.

    ``with dplab.Cluster(2) as c: c.run(fn, *args)`` returns ``fn``'s results indexed by rank,
    like :func:`dplab.launch`, but the processes, ``import torch`` and the process group are
    paid for once. A widget can then re-measure in well under a second.

    A rank that fails raises :class:`RankError`. If the other ranks finish, the pool stays
    usable; if they are stuck (say, in a collective the failed rank never joined), every rank is
    stopped and the pool says so until :meth:`restart`. A rank that dies between runs is found
    by the next run (a RankError naming it), and ``alive`` says so at once. A call that destroys
    the ranks' process group (``dist.destroy_process_group()``) gets its result, and the pool
    restarts so the next call has a group again.

    Calls from several threads are served one at a time (a lock). A Cluster cannot be pickled:
    a function that refers to the pool it runs on is refused with a message saying so.
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
        self._logs: list[RankOutput] = []
        self._logdir: str | None = None
        self._owner_pid = os.getpid()
        self._counts: Any = None
        self._store = None
        self._call_ids = itertools.count(1)
        self._pending: set[int] = set()
        self._group_lost: list[int] = []
        self._lock = threading.Lock()
        self.dead_reason: str | None = "not started"
        watch_ipython_history()
        LIVE.add(self)
        self._start()

    def __reduce__(self) -> Any:
        raise TypeError(
            "a dplab.Cluster cannot be pickled: it is this process's handle on its rank "
            "processes (pipes, a lock), and cannot be sent to them. A function run on the pool "
            "already runs on every rank: use torch.distributed inside it, not the `cluster` "
            "(a function that names the notebook's cluster captures it)"
        )

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """Started, not stopped, and every rank process still running."""
        return self.dead_reason is None and all(p.poll() is None for p in self._procs)

    @property
    def started(self) -> bool:
        """Whether rank processes were started and not yet stopped (alive or not)."""
        return bool(self._procs)

    def _start(self) -> None:
        _remove_stale_logdirs()
        self._owner_pid = os.getpid()
        # The owner's pid is in the name, so a later pool can remove a folder whose owner died.
        self._logdir = tempfile.mkdtemp(prefix=f"{LOG_PREFIX}{os.getpid()}-")
        counts_path = os.path.join(self._logdir, "collectives")
        with open(counts_path, "wb") as f:
            f.write(bytes(8 * self.world_size))
        with open(counts_path, "r+b") as f:
            self._counts = memoryview(mmap.mmap(f.fileno(), 8 * self.world_size)).cast("q")
        try:
            env = self._rank_env(self._listen(), counts_path)
            for rank in range(self.world_size):
                self._start_rank(rank, env)
            self._collect(0, START_TIMEOUT_S, what="start")
        except BaseException:
            self._stop(force=True)
            raise
        self.dead_reason = None

    def _listen(self) -> int:
        """Host the rendezvous store on 127.0.0.1; its port."""
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
        return port

    def _rank_env(self, port: int, counts_path: str) -> dict[str, str]:
        threads = max(1, usable_cpus() // self.world_size)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            WORLD_SIZE=str(self.world_size),
            LOCAL_WORLD_SIZE=str(self.world_size),
            DPLAB_BACKEND=self.backend,
            DPLAB_PARENT_PID=str(os.getpid()),
            DPLAB_LOGDIR=str(self._logdir),
            DPLAB_COUNTS=counts_path,
            OMP_NUM_THREADS=str(threads),
            GLOO_SOCKET_IFNAME=_loopback_interface(),
            PYTHONUNBUFFERED="1",
        )
        env.update(self._extra_env)
        return env

    def _start_rank(self, rank: int, base_env: dict[str, str]) -> None:
        parent_end, child_end = Pipe(duplex=True)
        life_read, life_write = os.pipe()
        log_path = os.path.join(str(self._logdir), f"rank{rank}.log")
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
        self._procs.append(proc)
        self._conns.append(parent_end)
        self._lifelines.append(life_write)
        self._logs.append(RankOutput(rank, log_path))

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
        if os.getpid() != self._owner_pid:
            # A forked child (its atexit hooks, a finalizer): the ranks and their log folder
            # are the parent's. Drop this copy's handles only.
            self._forget()
            return
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
        self._forget()
        if self._logdir is not None:
            shutil.rmtree(self._logdir, ignore_errors=True)
            self._logdir = None

    def _forget(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.close()
        for log in self._logs:
            log.close()
        for fd in self._lifelines:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._procs, self._conns, self._logs, self._lifelines = [], [], [], []
        self._store = None
        self._counts = None  # the mapping goes with the last reference
        if os.getpid() != self._owner_pid:
            self._logdir = None
            self.dead_reason = "a copy in a forked process (the ranks belong to the parent)"

    def _first_dead_rank(self) -> int | None:
        return next((r for r, p in enumerate(self._procs) if p.poll() is not None), None)

    def _exit_of(self, rank: int | None) -> str:
        return "" if rank is None else _describe_exit(self._procs[rank].poll())

    def _fail_dead_rank(self, rank: int, when: str) -> RankError:
        """Stop the pool because ``rank`` died ``when``; the error to raise."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._procs[rank].wait(timeout=5)
        cause = f"the rank process {self._exit_of(rank)} {when}"
        detail = cause + self._log_tail(rank)
        self._stop(force=True)
        self.dead_reason = f"rank {rank} {_describe_exit_short(detail)}; call .restart()"
        return RankError(
            rank,
            detail + "\nall ranks were stopped; call .restart() for a fresh pool",
            summary=cause,
        )

    # -- running --------------------------------------------------------------------------------

    def run(self, fn: Callable, /, *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results indexed by rank.

        Every keyword goes to ``fn``; a deadline for this call alone is :meth:`run_within`'s.
        """
        if "timeout_s" in kwargs and not _takes_keyword(fn, "timeout_s"):
            raise TypeError(
                f"Cluster.run passes every keyword to {getattr(fn, '__name__', fn)!r}, which "
                f"takes no timeout_s; for a deadline on this call, use "
                f"cluster.run_within({kwargs['timeout_s']!r}, fn, ...)"
            )
        with self._lock:
            return self._run(self.timeout_s, fn, args, kwargs)

    def run_within(self, timeout_s: float, fn: Callable, /, *args: Any, **kwargs: Any) -> list[Any]:
        """:meth:`run` with its own deadline (a checker bounds a learner's code by its own time).

        Past ``timeout_s`` the ranks are stopped (:class:`RankTimeout`), as at the pool's.
        """
        timeout_s = check_timeout(timeout_s)
        with self._lock:
            return self._run(timeout_s, fn, args, kwargs)

    def _run(self, timeout_s: float, fn: Callable, args: tuple, kwargs: dict) -> list[Any]:
        if self.dead_reason is not None:
            raise RuntimeError(
                f"this Cluster is stopped ({self.dead_reason}); call .restart() for a fresh one"
            )
        payload = pickle_call(fn, args, kwargs)
        died = self._first_dead_rank()
        if died is not None:
            raise self._fail_dead_rank(died, "while the pool was idle (between runs)")
        call_id = next(self._call_ids)
        message = CALL_HEADER.pack(CALL, call_id) + payload
        self._pending = set(range(self.world_size))
        self._group_lost = []
        sent = False
        try:
            for rank, conn in enumerate(self._conns):
                try:
                    conn.send_bytes(message)
                except OSError:
                    raise self._fail_dead_rank(rank, "before it received the call") from None
            sent = True
            return self._collect(call_id, timeout_s, what="run")
        except KeyboardInterrupt:
            self._interrupted(call_id, sent=sent)
            raise
        finally:
            if self._group_lost and self.alive:
                self._restore_group()

    def _restore_group(self) -> None:
        """The call destroyed the ranks' process group: start the pool again, saying why."""
        ranks = ", ".join(map(str, self._group_lost))
        print(
            f"[dplab] the call destroyed the process group on rank(s) {ranks} "
            f"(dist.destroy_process_group()): restarting {self.world_size} ranks so the next "
            "call has one (the pool owns the group; a function run on it should not destroy it)",
            file=sys.stderr,
        )
        self.restart()

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
        replies = Replies(self.world_size, timeout_s)
        self._pending = replies.pending
        returned: dict[int, int] = {}  # collectives issued by the ranks that returned
        ok_counts: dict[int, int] = {}
        for log in self._logs:
            log.new_call()
        while not replies.over:
            waiting = [self._conns[r] for r in replies.pending]
            for conn in mpc.wait(waiting, timeout=replies.wait_s()):
                rank = self._conns.index(conn)
                self._take_reply(rank, call_id, what, replies, returned, ok_counts)
            for log in self._logs:
                log.trim()
            if what == "run" and replies.pending and ok_counts and not replies.errors:
                self._check_desync(ok_counts, replies.pending)
        self._relay_output()
        if what == "run" and not replies.pending and len(set(returned.values())) > 1:
            self._stop(force=True)
            self.dead_reason = (
                f"the ranks issued different numbers of collectives ({_counts_text(returned)}): "
                "their next collectives would pair with the wrong partners"
            )
            if not replies.errors:
                raise RankError(
                    max(returned, key=returned.__getitem__),
                    f"the ranks issued different collectives ({_counts_text(returned)} "
                    "on the default group); all ranks were stopped, call .restart()",
                )
        if replies.errors:
            first = next(iter(replies.errors))
            died = [r for r, p in enumerate(self._procs) if p.poll() is not None]
            if self._procs and (replies.pending or died or what == "start"):
                self._stop(force=True)
                self.dead_reason = f"rank {first} failed during {what}; all ranks were stopped"
            replies.raise_errors()
        if replies.pending:
            stacks = self._stacks(replies.pending) if what == "run" else {}
            self._stop(force=True)
            self.dead_reason = f"ranks {sorted(replies.pending)} timed out during {what}"
            raise RankTimeout(sorted(replies.pending), timeout_s, stacks=stacks)
        return replies.in_rank_order()

    def _take_reply(
        self,
        rank: int,
        call_id: int,
        what: str,
        replies: Replies,
        returned: dict[int, int],
        ok_counts: dict[int, int],
    ) -> None:
        """Read rank's reply (or find it dead) and enter it in the books."""
        try:
            reply = Reply(*self._conns[rank].recv())
        except (EOFError, OSError):
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._procs[rank].wait(timeout=5)
            cause = f"the rank process {self._exit_of(rank)} during {what}"
            summary = f"{cause}, without a Python traceback (os._exit, a signal or a crash)"
            replies.error(rank, cause + self._log_tail(rank), summary=summary)
            return
        if reply.call_id != call_id:
            return  # the reply to an earlier, abandoned call: never this call's
        if reply.collectives is not None:
            returned[rank] = reply.collectives
        if reply.group_lost:
            self._group_lost.append(rank)
        if reply.kind != "ok":
            replies.error(rank, reply.body)
            return
        try:
            value = cloudpickle.loads(reply.body)
        except Exception as e:
            replies.error(
                rank,
                f"rank {rank} returned a value that cannot be unpickled in the caller: {e!r}. "
                "Return plain types (numbers, lists, dicts, tensors) or classes the caller can "
                "import.",
            )
            return
        if reply.collectives is not None:
            ok_counts[rank] = reply.collectives
        replies.ok(rank, value)

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
            with contextlib.suppress(OSError):
                sizes[rank] = self._logs[rank].size()
                os.kill(self._procs[rank].pid, signal.SIGUSR1)
        out: dict[int, str] = {}
        deadline = time.monotonic() + 1.0
        while sizes and time.monotonic() < deadline:
            time.sleep(0.05)
            for rank in list(sizes):
                stack = main_thread_stack(self._logs[rank].read_from(sizes[rank]))
                if stack:
                    out[rank] = stack
                    del sizes[rank]
        time.sleep(0.05)  # the dump's last lines
        for rank in ranks:
            self._logs[rank].skip_to_end()
        return out

    # -- rank output ----------------------------------------------------------------------------

    def _relay_output(self) -> None:
        """Show what ranks printed, prefixed by rank (ranks should return values, not print)."""
        for log in self._logs:
            log.relay()

    def _log_tail(self, rank: int, lines: int = 30) -> str:
        tail = self._logs[rank].tail(lines) if rank < len(self._logs) else ""
        return "; its last output:\n" + tail if tail else ""
