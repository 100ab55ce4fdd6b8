"""The warm pool: rank processes that outlive a cell, each running the calls the caller sends.

The rendezvous store lives in this (the calling) process, bound to 127.0.0.1 on a port the OS
picked, so two pools at once never collide and nothing listens on other interfaces. Gloo is
pinned to the loopback interface in the ranks for the same reason.

The ranks run in a process group of their own (:mod:`~dplab.launch.processes`): the interrupt
is the caller's, which stops a run it interrupts (see :meth:`Cluster._interrupted`), and an
interrupt of an unrelated cell leaves the pool alive. Where a stuck rank is comes from
:mod:`~dplab.launch.stacks`.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import itertools
import mmap
import multiprocessing.connection as mpc
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import cloudpickle

from dplab.env import resolve_backend
from dplab.launch.capacity import check_capacity, check_timeout, check_world_size
from dplab.launch.collect import Replies
from dplab.launch.errors import RankError, RankTimeout
from dplab.launch.history import LIVE, watch_ipython_history
from dplab.launch.output import RankOutput
from dplab.launch.processes import (
    LOG_PREFIX,
    describe_exit,
    make_logdir,
    rank_env,
    remove_stale_logdirs,
    start_rank,
)
from dplab.launch.protocol import CALL, CALL_HEADER, STOP, Reply, pickle_call
from dplab.launch.stacks import dump_stacks, main_thread_stack
from dplab.launch.torchrun import DEFAULT_TIMEOUT_S

__all__ = [  # the pool, and the names this module had before its parts moved out
    "INTERRUPT_GRACE_S",
    "LOG_PREFIX",
    "START_TIMEOUT_S",
    "Cluster",
    "main_thread_stack",
]

START_TIMEOUT_S = 120.0
# After a KeyboardInterrupt, how long the ranks get to finish the interrupted call before the
# pool is stopped (the stop button must answer within ~2 s).
INTERRUPT_GRACE_S = 1.0


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


def _describe_exit_short(detail: str) -> str:
    return detail.split(";", 1)[0].removeprefix("the rank process ")


def _counts_text(counts: dict[int, int]) -> str:
    return ", ".join(f"rank {r}: {n}" for r, n in sorted(counts.items()))


@atexit.register
def _stop_all_pools() -> None:
    """At the interpreter's exit (atexit calls it, nothing else): stop every live pool's ranks.

    A pool's ``__del__`` does this too, but not for a pool still referenced when the interpreter
    ends (a daemon thread holding it, a module attribute): its ranks would then exit on their
    own, after the caller, through their lifeline. Measured on 2 cores, a script whose daemon
    thread holds a 2-rank pool: a rank still alive when the script returned in 4 of 8 runs
    without this hook, in 0 of 8 with it.
    """
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
        remove_stale_logdirs()
        self._owner_pid = os.getpid()
        self._logdir = make_logdir()
        counts_path = os.path.join(self._logdir, "collectives")
        with open(counts_path, "wb") as f:
            f.write(bytes(8 * self.world_size))
        with open(counts_path, "r+b") as f:
            self._counts = memoryview(mmap.mmap(f.fileno(), 8 * self.world_size)).cast("q")
        try:
            env = rank_env(
                world_size=self.world_size,
                backend=self.backend,
                port=self._listen(),
                logdir=self._logdir,
                counts_path=counts_path,
                extra=self._extra_env,
            )
            for rank in range(self.world_size):
                proc, conn, lifeline, log = start_rank(rank, env, self._logdir)
                self._procs.append(proc)
                self._conns.append(conn)
                self._lifelines.append(lifeline)
                self._logs.append(log)
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
        return "" if rank is None else describe_exit(self._procs[rank].poll())

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
        return dump_stacks({r: self._procs[r].pid for r in sorted(ranks)}, self._logs)

    # -- rank output ----------------------------------------------------------------------------

    def _relay_output(self) -> None:
        """Show what ranks printed, prefixed by rank (ranks should return values, not print)."""
        for log in self._logs:
            log.relay()

    def _log_tail(self, rank: int, lines: int = 30) -> str:
        tail = self._logs[rank].tail(lines) if rank < len(self._logs) else ""
        return "; its last output:\n" + tail if tail else ""
