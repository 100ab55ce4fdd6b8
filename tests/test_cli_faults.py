"""Issue 27, the command line under faults: full disks, torchrun's world size, bad numbers to
``cluster``, a reader that goes away, a folder whose name is not UTF-8.

Each test failed on main before the fix (its docstring says how). Where nothing may be measured
before the check, ``no_ranks`` makes starting a rank an error. The full-disk tests mount a tiny
tmpfs (root; skipped elsewhere with the reason) and unmount it in a ``finally``.
"""

from __future__ import annotations

import errno
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import dplab
from dplab.cli import main
from dplab.trace import load_run
from dplab.trace.files import save_run
from tests.conftest import one_line_error

ROOT = Path(__file__).resolve().parents[1]
COMMITTED_RUN = ROOT / "assets" / "traces" / "tiny-gpt-2ranks-cap5"
TORCH_TRACES = ROOT / "assets" / "traces" / "torch-ddp-tiny-gpt-2ranks-cap0.5"


def _mount_tmpfs(folder: Path, size: str) -> None:
    folder.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(folder)],
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {made.stderr.strip()}")


def fill(disk: Path) -> None:
    """Write into ``disk`` until it says ENOSPC: a full disk that still takes empty files."""
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for chunk in (1 << 16, 1 << 12, 1):
            try:
                while True:
                    os.write(fd, b"x" * chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)


@pytest.fixture
def full_disk(tmp_path):
    """A 64 KiB tmpfs, filled: creating a file there works, writing one byte does not."""
    disk = tmp_path / "full"
    _mount_tmpfs(disk, "64k")
    try:
        fill(disk)
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.fixture
def small_disk(tmp_path):
    """A 10 MiB tmpfs: room for one output, until the test fills it during the 'measuring'."""
    disk = tmp_path / "small"
    _mount_tmpfs(disk, "10m")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


# -- full disks: refused before measuring; a disk that fills during the run loses nothing --------


def test_trace_refuses_a_full_disk_before_measuring(full_disk, no_ranks, capsys):
    """Before: the writability probe (an empty temporary file) passed on the full disk, the
    ranks measured, then save_run died in an OSError traceback and the steps were lost."""
    assert main(["trace", "--out", str(full_disk / "run")]) == 2
    one_line_error(capsys, "--out", "MiB free", "nothing was measured")


def test_bandwidth_refuses_a_full_disk_before_measuring(full_disk, no_ranks, capsys):
    """Before: measured every size, printed the table, then an OSError traceback."""
    argv = ["bandwidth", "--max-size-mb", "0.0625", "--html", str(full_disk / "b.html")]
    assert main(argv) == 2
    one_line_error(capsys, "--html", "MiB free")


def test_doctor_refuses_a_full_disk_before_reading_the_traces(full_disk, monkeypatch, capsys):
    """Before: read and diagnosed the traces, printed the advice, then an OSError traceback
    from writing timeline.html."""
    from dplab.trace import profiler

    def must_not_read(*a, **k):
        raise AssertionError("the traces were read before the output was checked")

    monkeypatch.setattr(profiler, "from_profiler", must_not_read)
    assert main(["doctor", str(TORCH_TRACES), "--html", str(full_disk / "t.html")]) == 2
    one_line_error(capsys, "--html", "MiB free")


def test_a_disk_that_fills_during_trace_keeps_the_old_run_whole(small_disk, monkeypatch, capsys):
    """Before: the OSError of the failed write came out as a traceback. Now one line, exit 1,
    the run already in --out untouched and no temporary folder left."""
    out = small_disk / "run"
    save_run(load_run(COMMITTED_RUN), out, {"command": "the old run"})
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def measure_then_fill(*args, **kwargs):
        fill(small_disk)  # the disk fills while the ranks measure
        return load_run(COMMITTED_RUN)

    monkeypatch.setattr(dplab, "launch", measure_then_fill)
    assert main(["trace", "--out", str(out), "--overwrite", "--steps", "2"]) == 1
    one_line_error(capsys, "--out", "No space left on device", "unchanged")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler", "run"]


def test_a_disk_that_fills_during_bandwidth_keeps_the_old_page(small_disk, monkeypatch, capsys):
    """Before: an OSError traceback after the table. Now one line, exit 1, the old page whole."""
    from dplab.cli import bandwidth as verb
    from dplab.collectives.bench import BandwidthRow

    def rows_then_fill(world_size, *, sizes, **_):
        fill(small_disk)
        return [
            BandwidthRow("all_reduce", world_size, s, 1e-5 + s * 1e-9, s / 1e4, s / 1e4, 1)
            for s in sizes
        ]

    page = small_disk / "b.html"
    page.write_text("OLD")
    monkeypatch.setattr(verb, "measure_bandwidth", rows_then_fill)
    assert main(["bandwidth", "--max-size-mb", "0.0625", "--html", str(page)]) == 1
    one_line_error(capsys, "--html", "No space left on device")
    assert page.read_text() == "OLD"
    assert sorted(p.name for p in small_disk.iterdir()) == ["b.html", "filler"]


# -- cluster: torchrun's world size, bad numbers, capacity ------------------------------------


@pytest.fixture
def under_torchrun(monkeypatch):
    """The environment torchrun gives rank 0 of ``cluster --nodes 2 --ranks-per-node 2``."""
    for name, value in {
        "RANK": "0",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29511",
    }.items():
        monkeypatch.setenv(name, value)


def test_check_under_torchrun_runs_at_torchrun_s_world_size(under_torchrun, monkeypatch, capsys):
    """Before: check launched at its --world-size default of 2 inside a group of 4, and every
    rank failed ("rank -1 failed" from the cluster)."""
    asked = []

    def launch(fn, world_size, **kwargs):
        asked.append(world_size)
        return [float(sum(range(1, world_size + 1)))] * world_size

    monkeypatch.setattr(dplab, "launch", launch)
    assert main(["check"]) == 0
    assert asked == [4]
    assert "ok: every rank holds 10 = 1 + … + 4" in capsys.readouterr().out


def test_bandwidth_under_torchrun_runs_at_torchrun_s_world_size(under_torchrun, monkeypatch):
    """Before: bandwidth measured at its --world-size default of 2 inside a group of 4."""
    from dplab.cli import bandwidth as verb

    asked = []

    def rows(world_size, *, sizes, **_):
        asked.append(world_size)
        return []

    monkeypatch.setattr(verb, "measure_bandwidth", rows)
    monkeypatch.setattr(verb, "fit_rows", lambda rows: {})
    assert main(["bandwidth", "--max-size-mb", "0.0625"]) == 0
    assert asked == [4]


@pytest.fixture
def no_nodes(monkeypatch):
    """Building the namespaces is a test failure (the numbers are checked first)."""
    import dplab.nodes

    def refuse(*args, **kwargs):
        raise AssertionError("the nodes were built before the arguments were checked")

    monkeypatch.setattr(dplab.nodes, "Nodes", refuse)


BAD_CLUSTER_ARGS = [
    (["--nodes", "0"], ("--nodes 0", "positive int")),
    (["--nodes", "-1"], ("--nodes -1", "positive int")),
    (["--nodes", "251"], ("--nodes 251", "at most 250")),
    (["--ranks-per-node", "0"], ("--ranks-per-node 0", "positive int")),
    (["--ranks-per-node", "-2"], ("--ranks-per-node -2", "positive int")),
    (["--link-mbit", "0"], ("--link-mbit 0", "> 0")),
    (["--link-mbit", "-5"], ("--link-mbit -5", "> 0")),
    (["--link-mbit", "nan"], ("--link-mbit nan", "finite")),
    (["--link-mbit", "inf"], ("--link-mbit inf", "finite")),
    (["--link-mbit", "1e9"], ("--link-mbit 1000000000.0", "100000 Mbit/s")),
    (["--link-mbit", "0.01"], ("--link-mbit 0.01", "between 0.1")),
    (["--timeout-s", "0"], ("--timeout-s 0", "> 0")),
    (["--timeout-s", "-1"], ("--timeout-s -1", "> 0")),
    (["--timeout-s", "nan"], ("--timeout-s nan", "finite")),
    (["--timeout-s", "inf"], ("--timeout-s inf", "finite")),
]


@pytest.mark.parametrize(("argv", "needles"), BAD_CLUSTER_ARGS, ids=lambda a: " ".join(a))
def test_cluster_refuses_bad_numbers_in_one_line(argv, needles, no_nodes, capsys):
    """Before: a ValueError traceback from inside Nodes/Network (or, for inf, a run)."""
    assert main(["cluster", *argv, "--", "check"]) == 2
    one_line_error(capsys, *needles)


def test_cluster_refuses_more_ranks_than_the_machine_holds(no_nodes, capsys):
    """Before: ``--ranks-per-node 20`` started 40 torch ranks on 2 cores, no check at all."""
    from dplab.launch import check_capacity

    per_node = 1
    while True:  # the first count this machine refuses (20 on the 2-core CI machine)
        try:
            check_capacity(2 * per_node)
        except ValueError:
            break
        per_node += 1
    assert main(["cluster", "--nodes", "2", "--ranks-per-node", str(per_node), "--", "check"]) == 2
    one_line_error(capsys, f"world_size={2 * per_node}", "more ranks than this machine can hold")


# -- a reader that goes away; a file name that is not UTF-8 ----------------------------------


def test_a_closed_pipe_ends_the_verb_quietly():
    """``python -m dplab simulate … | head -1``. Before: a BrokenPipeError traceback, and then
    "Exception ignored … BrokenPipeError" at exit. Now no output on stderr, status 141 (128 +
    SIGPIPE), as a Unix tool killed by SIGPIPE reports."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "dplab", "simulate", "--model", "gpt-7m"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()  # the reader is gone before the first line is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141
    assert err == "", err


def test_doctor_on_a_folder_whose_name_is_not_utf8(tmp_path, monkeypatch):
    """Before: the advice was printed, then plotly refused the title ("str is not valid UTF-8:
    surrogates not allowed") and no timeline was written. (stdout is a StringIO here: it holds
    the name's lone surrogate as it is, which pytest's capture could not decode.)"""
    folder = Path(os.fsdecode(os.fsencode(tmp_path) + b"/caf\xe9"))
    shutil.copytree(TORCH_TRACES, folder)
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    assert main(["doctor", str(folder)]) == 0
    page = (folder / "timeline.html").read_text(encoding="utf-8")
    assert 'caf\ufffd"' in page  # the title ends in the name, its bad byte as U+FFFD
    assert f"timeline: {folder / 'timeline.html'}" in out.getvalue()
