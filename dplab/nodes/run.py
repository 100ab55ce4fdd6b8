"""``Nodes``: a multi-node cluster on one machine, and torchrun on every node of it.

``with Nodes(2, ranks_per_node=2, link_mbit=400) as c: c.run(fn, *args)`` starts
``python -m torch.distributed.run`` inside each node's namespace (the c10d rendezvous hosted by
node 0 on its address, gloo pinned to the node's interface) and returns ``fn``'s results indexed
by global rank, like :func:`dplab.launch`. ``c.run_module("dplab", ["trace", …])`` runs a module
the same way: any code that calls :func:`dplab.launch` runs in place on its torchrun rank.

Failures end the run, never hang it: a rank that raises gives :class:`dplab.RankError` with its
traceback (the other ranks get a short grace, then are killed); a node whose ranks never start
(say it cannot reach node 0) gives :class:`RendezvousError` within ``rdzv_timeout_s``; a run
past ``timeout_s`` gives :class:`dplab.RankTimeout`. Between runs nothing runs in the namespaces.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dplab.launch.collect import Replies
from dplab.launch.errors import RankError, RankTimeout
from dplab.launch.protocol import pickle_call
from dplab.nodes.netns import Network, kill_inside

RDZV_PORT = 29400
_ROOT_CAUSE = re.compile(r"Root Cause.*?rank\s*:\s*(?P<rank>\d+)", re.DOTALL)
_CPP_FRAME = re.compile(r"^\s*(frame #\d+:|<omitting python frames>|Exception raised from )")
_runs = itertools.count()


def _gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for torchrun to reap it counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


class RendezvousError(RuntimeError):
    """Some nodes' ranks never started: the torchrun rendezvous did not complete in time."""

    def __init__(self, nodes: Sequence[int], message: str):
        self.nodes = sorted(nodes)
        super().__init__(message)


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class Nodes:
    """``nodes`` namespaces with ``ranks_per_node`` torchrun ranks each, linked at ``link_mbit``.

    ``placement`` (after a run): the node of each global rank; torchrun numbers ranks node by
    node, but which node gets the first numbers is the rendezvous' choice.
    """

    def __init__(
        self,
        nodes: int,
        ranks_per_node: int = 1,
        *,
        link_mbit: float | None = None,
        timeout_s: float = 300.0,
        rdzv_timeout_s: float = 60.0,
        threads_per_rank: int | None = None,
    ):
        _positive_int("nodes", nodes)
        self.ranks_per_node = _positive_int("ranks_per_node", ranks_per_node)
        for name, value in (("timeout_s", timeout_s), ("rdzv_timeout_s", rdzv_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        self.timeout_s, self.rdzv_timeout_s = float(timeout_s), float(rdzv_timeout_s)
        self.world_size = nodes * ranks_per_node
        self.threads = (
            _positive_int("threads_per_rank", threads_per_rank)
            if threads_per_rank is not None
            else max(1, _usable_cpus() // self.world_size)
        )
        self.placement: list[int] = []
        self.network = Network(nodes, link_mbit=link_mbit)
        self._reaper: subprocess.Popen | None = None
        # Every run's folder lives in here; the owner's pid in its name marks its processes.
        self.tmp = tempfile.mkdtemp(prefix=f"dplab-nodes-{os.getpid()}-")
        try:
            self._start_reaper()
        except BaseException:
            self.network.close()
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise

    # -- lifecycle ----------------------------------------------------------------------------

    def _start_reaper(self) -> None:
        script = Path(__file__).with_name("_reaper.py")
        self._reaper = subprocess.Popen(
            [sys.executable, str(script), self.tmp, *self.network.names],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C in the caller's terminal must not reach it
        )

    @property
    def link_mbit(self) -> float | None:
        return self.network.link_mbit

    def set_link(self, link_mbit: float | None) -> None:
        """Reshape every node's link (Mbit/s each way; None: unshaped) for the next runs."""
        self.network.set_link(link_mbit)

    def cut(self, node: int) -> None:
        """Take node ``node``'s link down (to see a rendezvous fail)."""
        self.network.cut(node)

    def shaping(self, node: int = 0) -> str:
        """What the kernel says shapes node ``node``'s link: ``tc qdisc show`` on its interface
        (with a rate set, a ``tbf`` line with its rate and burst)."""
        n = self.network.nodes[node]
        cmd = ["ip", "netns", "exec", n.netns, "tc", "qdisc", "show", "dev", n.iface]
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()

    def close(self) -> None:
        """Delete every namespace (and what runs there) and stop the reaper."""
        self.network.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
        if self._reaper is not None:
            with contextlib.suppress(OSError):
                self._reaper.stdin.close()  # type: ignore[union-attr]
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._reaper.wait(timeout=10)
            if self._reaper.poll() is None:
                self._reaper.kill()
                self._reaper.wait()
            self._reaper = None

    def __enter__(self) -> Nodes:
        return self

    def __del__(self) -> None:
        # a notebook that drops its Nodes without close(): the namespaces go with the object
        with contextlib.suppress(Exception):
            self.close()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        rate = "unshaped" if self.link_mbit is None else f"{self.link_mbit:g} Mbit/s"
        return f"Nodes({len(self.network.nodes)} nodes × {self.ranks_per_node} ranks, links {rate})"

    # -- running ------------------------------------------------------------------------------

    def run(self, fn: Callable, *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank (process group joined); results by rank."""
        import cloudpickle

        payload = pickle_call(fn, args, kwargs)  # the same by-value shipping as dplab.launch
        with _Run(self, [], echo=True, stream=sys.stderr) as run:  # as dplab.launch shows it
            (run.dir / "call.pkl").write_bytes(payload)
            run.start()
            results = run.wait(expect_results=True)
        return [cloudpickle.loads(results[r]) for r in range(self.world_size)]

    def run_module(self, module: str, args: Sequence[str] = (), *, echo: bool = True) -> str:
        """``python -m module args…`` under torchrun on every node; return all nodes' output.

        With ``echo`` the output is shown as it comes, each line prefixed by its node.
        """
        if not isinstance(module, str) or not module:
            raise ValueError(f"module must be a module name, got {module!r}")
        with _Run(self, ["-m", module, *map(str, args)], echo=echo) as run:
            run.start()
            run.wait(expect_results=False)
            return run.output()


class _Run:
    """One torchrun launch on every node: its folder, its processes, and how it ended."""

    def __init__(self, owner: Nodes, tail: list[str], *, echo: bool, stream: Any = None):
        self.owner, self.tail, self.echo = owner, tail, echo
        self.stream = stream
        self.dir = Path(tempfile.mkdtemp(prefix="run-", dir=owner.tmp))
        (self.dir / "started").mkdir()
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Any] = []
        self.seen: list[bytes] = []
        self.shown: list[int] = []
        self.port = RDZV_PORT

    def __enter__(self) -> _Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        for log in self.logs:
            with contextlib.suppress(OSError):
                log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def start(self) -> None:
        o, net = self.owner, self.owner.network
        k, m = len(net.nodes), o.ranks_per_node
        port = self.port = RDZV_PORT + next(_runs) % 1000  # fresh: no TIME_WAIT from the last
        rdzv = int(o.rdzv_timeout_s) + 10
        base = {
            k_: v
            for k_, v in os.environ.items()
            if k_ not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
            and not k_.startswith("TORCHELASTIC_")
        }
        for node in net.nodes:
            conf = f"join_timeout={rdzv},read_timeout={rdzv}" + (
                ",is_host=1" if node.index == 0 else ""
            )
            cmd = [
                "ip", "netns", "exec", node.netns,
                sys.executable, "-m", "torch.distributed.run",
                "--nnodes", str(k), "--nproc-per-node", str(m),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{net.nodes[0].addr}:{port}",
                "--rdzv-id", f"{net.stem}-{port}", "--rdzv-conf", conf,
                "--local-addr", node.addr, "--max-restarts", "0", "--monitor-interval", "0.2",
                "-m", "dplab.nodes._rank", str(self.dir), *self.tail,
            ]  # fmt: skip
            env = dict(
                base,
                GLOO_SOCKET_IFNAME=node.iface,
                OMP_NUM_THREADS=str(o.threads),
                PYTHONUNBUFFERED="1",
                DPLAB_NODE=str(node.index),
                TMPDIR=str(self.dir),  # torchrun's torchelastic_* log folders go with the run
            )
            # c10d warns on every socket that a namespace cannot resolve its hostname: noise.
            env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
            log_path = self.dir / f"node{node.index}.log"
            with open(log_path, "wb") as log:
                self.procs.append(
                    subprocess.Popen(
                        cmd,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        cwd=os.getcwd(),
                        start_new_session=True,
                    )
                )
            self.logs.append(open(log_path, "rb"))  # noqa: SIM115 (tailed while it runs)
            self.seen.append(b"")
            self.shown.append(0)

    def stop(self) -> None:
        """Kill everything still running inside the nodes (the namespaces stay)."""
        if any(p.poll() is None for p in self.procs):
            kill_inside([n.netns for n in self.owner.network.nodes])
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        self.relay(final=True)

    def relay(self, *, final: bool = False) -> None:
        """Show the nodes' new output, a line at a time, prefixed by node."""
        for i, log in enumerate(self.logs):
            with contextlib.suppress(OSError, ValueError):
                chunk = log.read()
                if not chunk and not final:
                    continue
                self.seen[i] += chunk
                if self.echo:
                    # whole lines only: the rest waits for the next chunk (or the end)
                    shown = self.shown[i]
                    end = len(self.seen[i]) if final else self.seen[i].rfind(b"\n", shown) + 1
                    for line in self.seen[i][shown:end].decode(errors="replace").splitlines():
                        print(f"[node {i}] {line}", file=self.stream or sys.stdout, flush=True)
                    self.shown[i] = max(shown, end)

    def output(self) -> str:
        return "\n".join(
            f"[node {i}] {line}"
            for i, text in enumerate(self.seen)
            for line in text.decode(errors="replace").splitlines()
        )

    def _tail(self, node: int, lines: int = 25) -> str:
        text = [
            line
            for line in self.seen[node].decode(errors="replace").splitlines()
            if not _CPP_FRAME.match(line)
        ][-lines:]
        return "\n".join(f"    {line}" for line in text) or "    (no output)"

    def _markers(self) -> dict[int, tuple[int, int]]:
        """Rank → (node, pid) of every rank that has started."""
        out = {}
        for f in (self.dir / "started").iterdir():
            if f.name.startswith("rank") and not f.name.endswith(".tmp"):
                with contextlib.suppress(OSError, ValueError, IndexError):
                    node, pid = f.read_text().split()[:2]
                    out[int(f.name[4:])] = (int(node), int(pid))
        return out

    def _started(self) -> dict[int, int]:
        return {r: node for r, (node, _) in self._markers().items()}

    def _results(self) -> dict[int, tuple[str, bytes, float]]:
        out = {}
        for f in self.dir.glob("result*.pkl"):
            with contextlib.suppress(OSError, ValueError, EOFError, pickle.UnpicklingError):
                out[int(f.name[6:-4])] = pickle.loads(f.read_bytes())
        return out

    def _enter_results(self, replies: Replies) -> dict[int, tuple[str, bytes, float]]:
        """Enter the result files not seen yet in the books, the earliest written first."""
        results = self._results()
        for rank in sorted(results, key=lambda r: results[r][2]):
            kind, body, _ = results[rank]
            if rank in replies.pending:
                if kind == "ok":
                    replies.ok(rank, body)
                else:
                    replies.error(rank, body)
        return results

    def wait(self, *, expect_results: bool) -> dict[int, bytes]:
        """Wait until every node is done, a rank failed, or a deadline passed; then judge.

        The books and the clocks are :class:`dplab.launch.collect.Replies`, as for a Cluster's
        ranks; a node's torchrun that exits with an error starts the same grace period.
        """
        o = self.owner
        n = o.world_size
        t0 = time.monotonic()
        replies = Replies(n, o.timeout_s)
        outcome = "done"
        unreachable: dict[int, str] = {}
        while True:
            self.relay()
            self._enter_results(replies)
            codes = [p.poll() for p in self.procs]
            if any(c not in (None, 0) for c in codes):
                replies.failed()
            if all(c is not None for c in codes):
                break
            if replies.grace_end is not None and replies.expired:
                outcome = "failed"
                break
            if len(self._started()) < n and time.monotonic() - t0 > o.rdzv_timeout_s:
                outcome = "rendezvous"
                unreachable = self._probe()  # while node 0's store still listens
                break
            if replies.expired:
                outcome = "timeout"
                break
            time.sleep(0.05)
        exited = [p.poll() is not None for p in self.procs]  # by themselves, before the kill
        results = self._results()
        # Ranks gone without a result before anything was killed: they died by themselves.
        died = sorted(
            r for r, (_, pid) in self._markers().items() if r not in results and _gone(pid)
        )
        self.stop()
        results, started = self._enter_results(replies), self._started()
        o.placement = [started.get(r, -1) for r in range(n)]
        # A rank that died without a word (os._exit, a signal, a segfault) is the likelier root
        # cause than the peers that then lost their connections to it and raised.
        if expect_results and died:
            rank = self._root_cause(died)
            node = started[rank]
            raise RankError(
                rank,
                f"rank {rank} on node {node} died without reporting a result; node {node}'s "
                f"torchrun exited with code {self.procs[node].returncode}. Its last output:\n"
                + self._tail(node),
                others=dict(replies.errors),
                summary=f"rank {rank} on node {node} died without reporting a result",
            )
        replies.raise_errors()
        if len(started) < n:
            self._raise_early_failure(exited)
            self._raise_rendezvous(started, outcome, unreachable)
        missing = [r for r in range(n) if r not in results] if expect_results else []
        if outcome == "timeout":
            raise RankTimeout(missing or list(range(n)), o.timeout_s)
        self._raise_bad_exit(missing, started)
        return {r: body for r, (_, body, _) in results.items()}

    def _raise_bad_exit(self, missing: list[int], started: dict[int, int]) -> None:
        """A node's torchrun that failed, or ranks without a result, with no error to show."""
        codes = [p.returncode for p in self.procs]
        bad = [i for i, c in enumerate(codes) if c != 0]
        if missing or bad:
            node = bad[0] if bad else started[missing[0]]
            rank = next(
                (r for r in missing if started.get(r) == node), missing[0] if missing else -1
            )
            raise RankError(
                rank,
                f"node {node}'s torchrun exited with code {codes[node]}; its last output:\n"
                + self._tail(node),
            )

    def _raise_early_failure(self, exited: list[bool]) -> None:
        """Ranks that torchrun started but that died before their first line (an import error):
        the rendezvous worked, so this is a rank's failure, with torchrun's report."""
        for node, done in enumerate(exited):
            match = _ROOT_CAUSE.search(self.seen[node].decode(errors="replace"))
            if done and match:
                rank = int(match["rank"])
                raise RankError(
                    rank,
                    f"rank {rank} on node {node} failed as it started (before running anything); "
                    f"node {node}'s last output:\n" + self._tail(node, 40),
                )

    def _root_cause(self, died: list[int]) -> int:
        """Of ranks that died, the one torchrun's report calls the root cause (else the first)."""
        for node in sorted({self.owner.placement[r] for r in died}):
            text = self.seen[node].decode(errors="replace")
            match = _ROOT_CAUSE.search(text)
            if match and int(match["rank"]) in died:
                return int(match["rank"])
        return died[0]

    def _probe(self) -> dict[int, str]:
        """Which nodes cannot open a TCP connection to node 0's rendezvous port, and why."""
        net = self.owner.network
        host, port = net.nodes[0].addr, self.port
        code = (
            "import socket,sys\n"
            f"try: socket.create_connection(({host!r}, {port}), timeout=3).close()\n"
            "except OSError as e: print(e); sys.exit(1)"
        )
        out = {}
        for node in net.nodes[1:]:
            cmd = ["ip", "netns", "exec", node.netns, sys.executable, "-S", "-c", code]
            with contextlib.suppress(subprocess.TimeoutExpired):
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
                if done.returncode != 0:
                    out[node.index] = (done.stdout or done.stderr).strip() or "failed"
        return out

    def _raise_rendezvous(
        self, started: dict[int, int], outcome: str, unreachable: dict[int, str]
    ) -> None:
        net = self.owner.network
        k, m = len(net.nodes), self.owner.ranks_per_node
        counts = [sum(1 for node in started.values() if node == i) for i in range(k)]
        absent = sorted(unreachable) or [i for i in range(k) if counts[i] < m]
        why = (
            f"within rdzv_timeout_s={self.owner.rdzv_timeout_s:g}"
            if outcome == "rendezvous"
            else "(torchrun exited first)"
        )
        lines = [
            f"the torchrun rendezvous at node 0 ({net.nodes[0].addr}:{self.port}) did not "
            f"complete {why}; {len(started)} of {k * m} ranks started."
        ]
        for i, reason in sorted(unreachable.items()):
            node = net.nodes[i]
            lines.append(
                f"node {i} ({node.addr} on {node.iface}) cannot reach node 0 at "
                f"{net.nodes[0].addr}:{self.port}: {reason}"
            )
        if not unreachable:
            lines.append(f"node(s) {', '.join(map(str, absent))} did not start all their ranks.")
        for i in absent:
            lines.append(f"node {i}'s last output:")
            lines.append(self._tail(i, 8))
        raise RendezvousError(absent, "\n".join(lines))
