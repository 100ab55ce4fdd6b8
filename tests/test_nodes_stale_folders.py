"""Issue 27: the nodes' run folder of an owner that died with its reaper is removed by the next run.

``Nodes`` keeps each run's files in ``$TMPDIR/dplab-nodes-<owner pid>-*``; the owner removes it
on close and its reaper when the owner dies. Before: when both were SIGKILLed (an OOM kill of the
session, ``kill -9`` of the process group), the folder stayed for good. Now every new
``Network`` (so every ``Nodes``) removes the folders whose owner pid is dead, after their
namespaces, as ``dplab.launch`` does for its rank-log folders.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from dplab.nodes import netns as netns_mod
from dplab.nodes.netns import nodes_available, remove_leftovers, remove_stale_folders

ROOT = Path(__file__).resolve().parents[1]
AVAILABLE, WHY = nodes_available()


def _dead_pid() -> int:
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid is now free: an owner that no longer exists
    return dead.pid


def test_only_folders_of_dead_owners_are_removed(tmp_path):
    """Before: nothing removed them (remove_stale_folders did not exist)."""
    stale = tmp_path / f"dplab-nodes-{_dead_pid()}-abc"
    live = tmp_path / f"dplab-nodes-{os.getpid()}-def"
    other = tmp_path / "dplab-nodes-notapid-x"
    for folder in (stale, live, other):
        (folder / "run-1").mkdir(parents=True)
    assert remove_stale_folders(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and live.exists() and other.exists()


@pytest.mark.skipif(not AVAILABLE, reason=f"dplab.nodes unavailable: {WHY}")
def test_a_folder_left_by_a_killed_owner_and_reaper_goes_with_the_next_network():
    """Before: after SIGKILL of the owner and its reaper, the folder stayed for good."""
    script = textwrap.dedent(
        """
        import os, time
        from dplab.nodes import Nodes
        c = Nodes(1, 1)
        os.kill(c._reaper.pid, 9)  # the reaper first, so nothing is left to clean up
        c._reaper.wait()
        print(c.network.stem, c.tmp, flush=True)
        time.sleep(120)
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        stem, tmp = child.stdout.readline().split()  # type: ignore[union-attr]
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert Path(tmp).is_dir() and Path(tmp).parent == Path(tempfile.gettempdir())
    t0 = time.monotonic()
    remove_leftovers()  # what the next Network (and so the next Nodes) calls first
    assert time.monotonic() - t0 < 30
    assert not Path(tmp).exists()
    assert not any(n.startswith(stem) for n in netns_mod.list_netns())
