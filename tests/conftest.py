"""Shared fixtures. Tests start their own rank processes on 127.0.0.1 and end them."""

from __future__ import annotations

import os

import pytest

import dplab


@pytest.fixture(scope="session")
def cluster2():
    """A warm 2-rank gloo pool shared by the tests that only need ranks to exist."""
    with dplab.Cluster(2, backend="gloo") as c:
        yield c


def child_pids() -> set[int]:
    """PIDs of this process's live children (to prove no rank is left behind)."""
    me = os.getpid()
    out = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            out.add(int(pid))
    return out
