"""Nodes on one machine: network namespaces joined through a switch by rate-limited veth links.

Why namespaces? A rank inside a namespace has its own interfaces, addresses and routes, so
traffic between two namespaces really crosses a (virtual) link that ``tc`` can slow down, while
ranks inside one namespace still talk over its loopback. That is the two-level fabric of a real
cluster (fast inside a node, a slower network between nodes) on one box, with real sockets.

The layout, for ``k`` nodes::

    node 0 [dpn0 10.77.0.1] ==veth== [p0]                  every veth end shaped with a tbf
    node 1 [dpn1 10.77.0.2] ==veth== [p1]  switch: bridge  qdisc: node -> switch on dpnI,
    ...                                                    switch -> node on pI (full duplex)

Everything lives in namespaces created here (``dplab-n<owner pid>-<seq>-k<i>`` and ``...-sw``);
the veths are created directly inside them, so nothing in the root namespace changes, and
deleting the namespaces deletes the links. Namespaces whose owner pid is dead are leftovers of
a crashed run: :func:`remove_leftovers` deletes them (every :class:`Network` calls it first),
and with them the run folders ``dplab-nodes-<owner pid>-*`` in the temp dir, which the owner and
its reaper remove but which outlive both when both are SIGKILLed.
Only bandwidth can be shaped: this kernel has ``tbf`` but no ``netem``, so no delay is added.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from numbers import Real
from typing import Any

from dplab.env import pid_alive

PREFIX = "dplab-n"
_NAME = re.compile(rf"^{re.escape(PREFIX)}(?P<pid>\d+)-(?P<seq>\d+)-(?P<role>k\d+|sw)$")
SUBNET = "10.77.0"
# dplab.nodes.Nodes names its run folder so: tempfile.mkdtemp(prefix=f"dplab-nodes-{pid}-")
FOLDER_PREFIX = "dplab-nodes-"
_FOLDER = re.compile(rf"^{re.escape(FOLDER_PREFIX)}(?P<pid>\d+)-")
NEEDS = (
    "multi-node runs need root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2's `ip` and "
    "`tc` (with the tbf qdisc) on Linux"
)
_seq = itertools.count()


class NodesUnavailable(RuntimeError):
    """Namespaces cannot be created here; the message says what is missing."""


@dataclass(frozen=True)
class Node:
    """One node: its namespace, its interface toward the switch and its address there."""

    index: int
    netns: str
    iface: str
    addr: str


def _ip(*args: str, netns: str | None = None, check: bool = True) -> str:
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {out.stderr.strip() or out.returncode}")
    return out.stdout


def _tc(netns: str, *args: str) -> None:
    cmd = ["ip", "netns", "exec", netns, "tc", *args]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {out.stderr.strip() or out.returncode}")


def list_netns() -> list[str]:
    """Names of every network namespace ``ip netns`` knows (ours and anyone else's)."""
    if shutil.which("ip") is None:
        return []
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def ours(names: list[str] | None = None) -> list[str]:
    """The namespaces named by this module (any owner)."""
    return [n for n in (list_netns() if names is None else names) if _NAME.match(n)]


def _netns_pids(netns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def kill_inside(names: list[str]) -> None:
    """SIGKILL every process inside the namespaces ``names`` (until none is left)."""
    for _ in range(40):
        pids = [p for n in names for p in _netns_pids(n) if p != os.getpid()]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def delete_netns(names: list[str]) -> None:
    """Kill every process inside ``names``, then delete them (and with them, their veths).

    A namespace with a process still inside outlives ``ip netns del`` (only its name goes), so
    the processes go first; a process that forks while we kill is caught by the next round.
    """
    kill_inside(names)
    for name in names:
        _ip("netns", "del", name, check=False)


def remove_leftovers() -> list[str]:
    """Delete the namespaces, then the run folders, of runs whose owner process is dead;
    return the namespaces' names."""
    stale = [n for n in ours() if not pid_alive(int(_NAME.match(n)["pid"]))]  # type: ignore[index]
    if stale:
        delete_netns(stale)  # first: nothing runs in a folder once its namespaces are gone
    remove_stale_folders()
    return stale


def remove_stale_folders(root: str | None = None) -> list[str]:
    """Delete the ``dplab-nodes-<pid>-*`` folders (in ``root``, default the temp dir) whose
    owner pid is dead; return their paths. A folder of a live owner is never touched."""
    root = tempfile.gettempdir() if root is None else root
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            match = _FOLDER.match(name)
            path = os.path.join(root, name)
            if match and not pid_alive(int(match["pid"])) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def nodes_available() -> tuple[bool, str]:
    """Whether :class:`Network` can work here, and if not, why (a reason a test can skip with).

    It tries what a run needs: creating a namespace and a tbf qdisc inside it.
    """
    if os.uname().sysname != "Linux":
        return False, f"not Linux ({os.uname().sysname}); {NEEDS}"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` not found; {NEEDS}"
    probe = f"{PREFIX}{os.getpid()}-{next(_seq)}-sw"
    try:
        made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
        if made.returncode != 0:
            who = "root" if os.geteuid() == 0 else f"uid {os.geteuid()}, not root"
            return False, f"`ip netns add` failed ({made.stderr.strip()}; {who}); {NEEDS}"
        try:
            _ip("link", "add", "t0", "type", "veth", "peer", "name", "t1", netns=probe)
            _tc(probe, "qdisc", "add", "dev", "t0", "root", "tbf", *_tbf_args(100))
        except RuntimeError as e:
            return False, f"{e}; {NEEDS}"
    finally:
        _ip("netns", "del", probe, check=False)
    return True, "ok"


def tbf_burst_bytes(qdisc: str) -> int:
    """The bucket of a ``tc qdisc show`` line's ``tbf`` (``burst 256Kb`` is 256 KiB): the bytes
    that leave at once before the rate holds them back."""
    found = re.search(r"burst (\d+)([KM]?b)\b", qdisc)
    if found is None:
        raise ValueError(f"no tbf burst in {qdisc!r}: is the link shaped?")
    number, unit = found.groups()
    return int(number) * {"b": 1, "Kb": 2**10, "Mb": 2**20}[unit]


def _mbit(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not 0.1 <= value <= 100_000:
        raise ValueError(f"{name} must be a number of Mbit/s in [0.1, 100000], got {value!r}")
    return float(value)


def _tbf_args(mbit: float) -> list[str]:
    # tbf drops a packet larger than its bucket, and veth hands it GSO packets of up to 64 KiB:
    # the bucket holds a few of those, or 2 ms at the line rate when that is more.
    burst = max(256 * 1024, int(mbit * 1e6 / 8 * 0.002))
    return ["rate", f"{mbit:g}mbit", "burst", str(burst), "latency", "50ms"]


class Network:
    """``k`` node namespaces on a switch, each link shaped to ``link_mbit`` each way.

    ``link_mbit=None`` leaves the links unshaped (veth speed: several GB/s). Use as a context
    manager, or call :meth:`close`; both delete everything, and a crashed owner's namespaces
    are removed by the next Network (or by the reaper of :class:`dplab.nodes.Nodes`).
    """

    def __init__(self, k: int, *, link_mbit: float | None = None):
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 250:
            raise ValueError(f"the number of nodes must be an int in [1, 250], got {k!r}")
        if link_mbit is not None:
            _mbit("link_mbit", link_mbit)
        ok, why = nodes_available()
        if not ok:
            raise NodesUnavailable(why)
        remove_leftovers()
        stem = f"{PREFIX}{os.getpid()}-{next(_seq)}"
        self.stem = stem
        self.switch = f"{stem}-sw"
        self.nodes = [Node(i, f"{stem}-k{i}", f"dpn{i}", f"{SUBNET}.{i + 1}") for i in range(k)]
        self.link_mbit: float | None = None
        self._closed = False
        try:
            self._build()
            self.set_link(link_mbit)
        except BaseException:
            self.close()
            raise

    @property
    def names(self) -> list[str]:
        """Every namespace of this network."""
        return [self.switch, *(n.netns for n in self.nodes)]

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("link", "add", "br0", "type", "bridge", netns=self.switch)
        _ip("link", "set", "lo", "up", netns=self.switch)
        _ip("link", "set", "br0", "up", netns=self.switch)
        for node in self.nodes:
            _ip("netns", "add", node.netns)
            port = f"p{node.index}"
            # Created with both ends already in their namespaces: never visible in the root one.
            _ip(
                "link", "add", node.iface, "netns", node.netns, "type", "veth",
                "peer", "name", port, "netns", self.switch,
            )  # fmt: skip
            _ip("link", "set", port, "master", "br0", netns=self.switch)
            _ip("link", "set", port, "up", netns=self.switch)
            _ip("addr", "add", f"{node.addr}/24", "dev", node.iface, netns=node.netns)
            _ip("link", "set", "lo", "up", netns=node.netns)
            _ip("link", "set", node.iface, "up", netns=node.netns)

    def _ends(self) -> list[tuple[str, str]]:
        """(namespace, device) of every shaped egress: node → switch and switch → node."""
        return [
            end for n in self.nodes for end in ((n.netns, n.iface), (self.switch, f"p{n.index}"))
        ]

    def set_link(self, link_mbit: float | None) -> None:
        """Shape every node's link to ``link_mbit`` Mbit/s each way (None: unshaped)."""
        mbit = None if link_mbit is None else _mbit("link_mbit", link_mbit)
        for netns, dev in self._ends():
            if self.link_mbit is not None:
                _tc(netns, "qdisc", "del", "dev", dev, "root")
            if mbit is not None:
                _tc(netns, "qdisc", "add", "dev", dev, "root", "tbf", *_tbf_args(mbit))
        self.link_mbit = mbit

    def cut(self, index: int) -> None:
        """Take node ``index``'s link down: it can no longer reach any other node."""
        node = self.nodes[index]
        _ip("link", "set", node.iface, "down", netns=node.netns)

    def close(self) -> None:
        """Kill what runs inside and delete every namespace (idempotent)."""
        if self._closed:
            return
        self._closed = True
        present = set(list_netns())
        delete_netns([n for n in self.names if n in present])

    def __enter__(self) -> Network:
        return self

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        rate = "unshaped" if self.link_mbit is None else f"{self.link_mbit:g} Mbit/s"
        return f"Network({len(self.nodes)} nodes, links {rate}, {self.stem})"
