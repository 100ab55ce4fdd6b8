"""dplab.nodes: namespace nodes, shaped links, torchrun on every node — and nothing left behind.

Each test that builds nodes counts, before and after, the network namespaces, the links of the
root namespace and the processes whose command line names the run; a test passes only if all
three are back where they were (after success, a rank's exception, a rank's hard crash, a
KeyboardInterrupt and a SIGKILLed caller). Skipped, with the reason, without root or iproute2.
"""

from __future__ import annotations

import _thread
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import dplab
from dplab.nodes import (
    Network,
    Nodes,
    NodesUnavailable,
    RendezvousError,
    nodes_available,
    remove_leftovers,
    tbf_burst_bytes,
)
from dplab.nodes import netns as netns_mod

AVAILABLE, WHY = nodes_available()
needs_nodes = pytest.mark.skipif(not AVAILABLE, reason=f"dplab.nodes unavailable: {WHY}")
ROOT = Path(__file__).resolve().parents[1]


def _root_links() -> list[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return sorted(line.split(":")[1].strip() for line in out.splitlines())


def _processes(*markers: str) -> list[int]:
    """Live processes whose command line contains every one of ``markers``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if all(m in cmd for m in markers) and state != "Z" and int(pid) != os.getpid():
            found.append(int(pid))
    return found


def _mine(pid: int | None = None) -> tuple[str, str]:
    """What names the namespaces and agents (stem) and the ranks (run folder) of owner ``pid``."""
    pid = os.getpid() if pid is None else pid
    return f"{netns_mod.PREFIX}{pid}-", f"dplab-nodes-{pid}-"


def _ranks(pid: int | None = None) -> list[int]:
    """Rank processes of owner ``pid`` (not the torchrun agents, whose arguments name them)."""
    agents = set(_processes(_mine(pid)[1], "torch.distributed.run"))
    return [p for p in _processes(_mine(pid)[1], "-m dplab.nodes._rank") if p not in agents]


def _snapshot() -> dict[str, object]:
    stem, folder = _mine()
    other_owner = netns_mod._NAME.match
    return {
        "netns": sorted(
            n for n in netns_mod.list_netns() if n.startswith(stem) or not other_owner(n)
        ),
        "links": _root_links(),
        "agents_and_reapers": _processes(stem),
        "ranks": _processes(folder),
    }


@pytest.fixture
def no_leak():
    """Fails the test if namespaces, root links or run processes differ afterwards."""
    before = _snapshot()
    yield
    deadline = time.monotonic() + 10
    while _snapshot() != before and time.monotonic() < deadline:
        time.sleep(0.2)  # a reaper exits a moment after its owner closed the pipe
    assert _snapshot() == before


# -- rank functions -------------------------------------------------------------------------------


def _who(nbytes: int) -> dict:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    x = torch.ones(nbytes // 4)
    dist.all_reduce(x)  # warm the connections
    dist.barrier()
    t0 = time.perf_counter()
    dist.all_reduce(x)
    seconds = time.perf_counter() - t0
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "node": int(os.environ["DPLAB_NODE"]),
        "iface": os.environ["GLOO_SOCKET_IFNAME"],
        "netns": os.readlink("/proc/self/ns/net"),
        "sum": t.item(),
        "seconds": seconds,
        "in_place": dplab.launch(_rank_and_world, dist.get_world_size()),
    }


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def _raise_on_one() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    dist.barrier()


def _die_on_one() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


# -- tests ----------------------------------------------------------------------------------------


def test_unavailable_says_what_is_needed(monkeypatch):
    monkeypatch.setattr(netns_mod.shutil, "which", lambda tool: None)
    ok, why = nodes_available()
    assert not ok and "root" in why and "iproute2" in why and "`ip` not found" in why
    with pytest.raises(NodesUnavailable, match="CAP_NET_ADMIN"):
        Network(2)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="nodes must be a positive int, got 0"):
        Nodes(0)
    with pytest.raises(ValueError, match=r"ranks_per_node must be a positive int, got 1\.5"):
        Nodes(2, 1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"link_mbit .* got -5"):
        Network(2, link_mbit=-5)


def test_tbf_burst_is_read_from_tcs_own_line():
    line = "qdisc tbf 8001: root refcnt 2 rate 25Mbit burst 256Kb lat 50ms"
    assert tbf_burst_bytes(line) == 256 * 1024
    assert tbf_burst_bytes("qdisc tbf 8001: root rate 1Gbit burst 2Mb lat 50ms") == 2 * 2**20
    with pytest.raises(ValueError, match="no tbf burst in 'qdisc noqueue 0: root'"):
        tbf_burst_bytes("qdisc noqueue 0: root")


@needs_nodes
def test_shaping_reports_the_rate_that_was_set(no_leak):
    with Nodes(2, ranks_per_node=1, link_mbit=25) as nodes:
        line = nodes.shaping(0)
        assert "tbf" in line and "25Mbit" in line, line
        assert tbf_burst_bytes(line) >= 256 * 1024
        nodes.set_link(None)
        assert "tbf" not in nodes.shaping(0)


def test_ring_crossings():
    from dplab.cli.cluster import ring_crossings

    assert ring_crossings([0, 0, 1, 1]) == [(1, 2), (3, 0)]
    assert ring_crossings([0, 1, 2, 3]) == [(0, 1), (1, 2), (2, 3), (3, 0)]
    assert ring_crossings([0, 0]) == []


@needs_nodes
def test_two_nodes_run_and_leave_nothing(no_leak):
    mbit, nbytes = 100.0, 4 * 2**20
    with Nodes(2, 1, link_mbit=mbit) as cluster:
        out = cluster.run(_who, nbytes)
        placement = cluster.placement
    assert [r["rank"] for r in out] == [0, 1]
    assert all(r["world_size"] == 2 and r["sum"] == 3.0 for r in out)
    assert sorted(placement) == [0, 1] and [r["node"] for r in out] == placement
    assert [r["iface"] for r in out] == [f"dpn{node}" for node in placement]
    mine = os.readlink("/proc/self/ns/net")
    assert len({r["netns"] for r in out} | {mine}) == 3  # each rank in its own node, not ours
    # dplab.launch inside a torchrun rank runs in place and gathers every rank's result
    assert all(r["in_place"] == [(0, 2), (1, 2)] for r in out)
    # The link is shaped: a ring all-reduce cannot beat the line rate (a bound that a slow,
    # busy machine only makes safer). tbf lets one 256 KiB burst through at full speed.
    line_s = (nbytes - 256 * 1024) * 8 / (mbit * 1e6)
    assert min(r["seconds"] for r in out) >= line_s, out


@needs_nodes
def test_rank_errors_name_the_rank_and_leave_nothing(no_leak):
    with Nodes(2, 1, rdzv_timeout_s=60) as cluster:
        with pytest.raises(dplab.RankError) as raised:
            cluster.run(_raise_on_one)
        assert raised.value.rank == 1
        assert "ValueError: boom on purpose" in raised.value.traceback
        assert "_raise_on_one" in raised.value.traceback
        with pytest.raises(dplab.RankError) as died:
            cluster.run(_die_on_one)
        assert died.value.rank == 1
        assert "died without reporting a result" in str(died.value)
        assert _ranks() == []  # no rank runs between runs


@needs_nodes
def test_interrupt_leaves_nothing(no_leak):
    with Nodes(2, 1) as cluster:
        names = [n.netns for n in cluster.network.nodes]

        def interrupt_once_running() -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if len(_ranks()) >= 2:
                    time.sleep(0.5)
                    _thread.interrupt_main()
                    return
                time.sleep(0.1)

        threading.Thread(target=interrupt_once_running, daemon=True).start()
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            cluster.run(_sleep, 120)
        assert time.monotonic() - t0 < 60
        assert all(netns_mod._netns_pids(n) == [] for n in names)


@needs_nodes
def test_killed_caller_is_cleaned_up_by_the_reaper(no_leak):
    script = textwrap.dedent(
        """
        import sys, time
        from dplab.nodes import Nodes
        c = Nodes(2, 1)
        print(c.network.stem, c.tmp, flush=True)
        c.run(time.sleep, 120)
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        stem, tmp = child.stdout.readline().split()  # type: ignore[union-attr]
        deadline = time.monotonic() + 60
        while len(_ranks(child.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert any(n.startswith(stem) for n in netns_mod.list_netns())
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and (
        any(n.startswith(stem) for n in netns_mod.list_netns()) or _processes(stem)
    ):
        time.sleep(0.1)
    assert not any(n.startswith(stem) for n in netns_mod.list_netns())
    assert _processes(stem) == [] and _ranks(child.pid) == []
    assert not Path(tmp).exists()


@needs_nodes
def test_leftovers_of_a_dead_owner_are_removed():
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid is now free: an owner that no longer exists
    stale = f"{netns_mod.PREFIX}{dead.pid}-0-k0"
    alive = f"{netns_mod.PREFIX}{os.getpid()}-999-k0"
    for name in (stale, alive):
        subprocess.run(["ip", "netns", "add", name], check=True)
    inside = subprocess.Popen(["ip", "netns", "exec", stale, "sleep", "60"])
    try:
        deadline = time.monotonic() + 10
        while not netns_mod._netns_pids(stale) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stale in remove_leftovers()
        names = netns_mod.list_netns()
        assert stale not in names and alive in names  # a live owner's namespaces stay
        assert inside.wait(timeout=10) == -signal.SIGKILL
    finally:
        netns_mod.delete_netns([n for n in (stale, alive) if n in netns_mod.list_netns()])
        if inside.poll() is None:
            inside.kill()
            inside.wait()


@needs_nodes
def test_unreachable_node_fails_the_rendezvous_clearly(no_leak):
    # the probe names the cut node however soon the rendezvous gives up: 8 s, not torchrun's 60
    with Nodes(2, 1, rdzv_timeout_s=8) as cluster:
        cluster.cut(1)
        t0 = time.monotonic()
        with pytest.raises(RendezvousError) as raised:
            cluster.run(_rank_and_world)
        elapsed = time.monotonic() - t0
    assert raised.value.nodes == [1]
    message = str(raised.value)
    assert "node 1 (10.77.0.2 on dpn1) cannot reach node 0 at 10.77.0.1" in message
    assert "unreachable" in message.lower()
    assert elapsed < 30


@needs_nodes
def test_cluster_verb_traces_a_multi_node_run(tmp_path, no_leak, capsys):
    import argparse
    import json

    from dplab.cli import cluster as verb
    from dplab.trace import load_run

    parser = argparse.ArgumentParser()
    verb.add_cli(parser.add_subparsers(dest="verb"))
    out = tmp_path / "run"
    argv = ["cluster", "--nodes", "2", "--link-mbit", "400", "--", "trace", "--model",
            "tiny-gpt", "--steps", "1", "--warmup", "0", "--out", str(out)]  # fmt: skip
    args = parser.parse_args(argv)
    args.argv = argv[1:]
    assert args.func(args) == 0, capsys.readouterr()
    runs = load_run(out)
    assert len(runs) == 2 and all(len(steps) == 1 for steps in runs)
    assert {steps[0].world_size for steps in runs} == {2}
    info = json.loads((out / "cluster.json").read_text())
    assert sorted(info["placement"]) == [0, 1] and info["link_mbit"] == 400
    assert info["ring_crossings"] == [[0, 1], [1, 0]]
    assert "every all-reduce" in (out / "timeline_nodes.html").read_text()
