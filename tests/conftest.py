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


def no_rank_may_start(self) -> None:
    raise AssertionError("a rank process was started before the arguments were checked")


@pytest.fixture
def no_ranks(monkeypatch):
    """Starting a rank process is a test failure (checked before anything is measured)."""
    monkeypatch.setattr(dplab.Cluster, "_start", no_rank_may_start)


def one_line_error(capsys, *needles: str) -> str:
    """stderr is one line, ``error: ...``, holding every needle (the flag, the value, why)."""
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]
