"""The command line under bad input (docs/reliability.md): every verb refuses a bad value in one
line naming it, before any rank starts; outputs are checked before measuring, written atomically
with the umask, and never over an input or someone else's file.

Each test failed on the code before the fix. Where ranks must not start, ``no_ranks`` makes
starting one an error, so a verb that still measured before checking fails here at once instead
of after a minute of measuring.
"""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest

from dplab.cli import main
from dplab.launch import Cluster
from dplab.sim import BackwardProfile
from dplab.sim.link import ASSETS
from dplab.trace import load_run
from dplab.trace.files import save_run
from tests.conftest import no_rank_may_start, one_line_error

PROFILE = ASSETS / "profile_gpt-7m.json"


COMMITTED_RUN = ASSETS / "traces" / "tiny-gpt-2ranks-cap5"


FAULT_BOUND_S = 30.0  # the bound from the fault to the error


BAD_TRACE_ARGS = [
    (["--steps", "0"], ("--steps 0", "steps must be a positive int")),
    (["--warmup", "-1"], ("--warmup -1", "warmup must be an int >= 0")),
    (["--batch-size", "0"], ("--batch-size 0", "batch_size must be a positive int")),
    (["--bucket-cap-mb", "0"], ("--bucket-cap-mb 0", "bucket_cap_mb must be > 0")),
    (["--bucket-cap-mb", "nan"], ("--bucket-cap-mb nan", "finite")),
    (["--bucket-cap-mb", "1e-12"], ("1e-12", "0 bytes", "at least 1 byte")),
    (["--first-bucket-cap-mb", "-1"], ("--first-bucket-cap-mb -1", "must be > 0")),
    (["--world-size", "0"], ("--world-size 0", "world_size must be a positive int")),
    (["--world-size", "10000"], ("world_size=10000", "cores", "MB each")),
]


@pytest.mark.parametrize(("argv", "needles"), BAD_TRACE_ARGS, ids=lambda a: " ".join(a))
def test_trace_refuses_bad_numbers_in_one_line_before_any_rank_starts(
    argv, needles, tmp_path, no_ranks, capsys
):
    """Before: the ranks started, measured, and failed with a 17-30-line traceback each."""
    t0 = time.monotonic()
    assert main(["trace", "--out", str(tmp_path / "run"), *argv]) == 2
    assert time.monotonic() - t0 < FAULT_BOUND_S
    one_line_error(capsys, *needles)
    assert not (tmp_path / "run").exists()


def test_trace_refuses_an_output_it_cannot_write_before_measuring(tmp_path, no_ranks, capsys):
    """Before: ``--out /proc/forbidden`` ran every step, then died; ``--out ""`` wrote into the
    current folder; a file as ``--out`` was found after measuring."""
    assert main(["trace", "--out", "/proc/forbidden/run"]) == 2
    one_line_error(capsys, "--out", "/proc", "cannot create a file")
    assert main(["trace", "--out", ""]) == 2
    one_line_error(capsys, "--out is empty")
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    assert main(["trace", "--out", str(a_file)]) == 2
    one_line_error(capsys, str(a_file), "not a folder")
    assert a_file.read_text() == "mine"


def test_trace_never_overwrites_someone_elses_trace_json(tmp_path, no_ranks, capsys):
    """Before: a folder holding a foreign ``trace.json`` was measured into and overwritten."""
    folder = tmp_path / "theirs"
    folder.mkdir()
    (folder / "trace.json").write_text('{"theirs": true}')
    for extra in ([], ["--overwrite"]):
        assert main(["trace", "--out", str(folder), *extra]) == 2
        one_line_error(capsys, str(folder), "not a dplab run", "trace.json")
        assert (folder / "trace.json").read_text() == '{"theirs": true}'


def test_trace_replaces_a_run_only_with_overwrite(tmp_path, monkeypatch, capsys):
    """Before: a folder holding an earlier run was silently written over (and then, with the
    run-folder check in save_run, refused only after every step was measured)."""
    folder = tmp_path / "run"
    save_run(load_run(COMMITTED_RUN), folder)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    start = Cluster._start
    monkeypatch.setattr(Cluster, "_start", no_rank_may_start)
    assert main(["trace", "--out", str(folder), "--steps", "1"]) == 2
    monkeypatch.setattr(Cluster, "_start", start)
    one_line_error(capsys, str(folder), "already holds a run", "--overwrite")
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    argv = ["trace", "--out", str(folder), "--overwrite", "--model", "mlp", "--steps", "1"]
    argv += ["--warmup", "0", "--batch-size", "2", "--backend", "gloo"]
    assert main(argv) == 0
    runs = load_run(folder)
    assert len(runs) == 2 and runs[0][0].meta["model"] == "mlp"
    assert (folder / "timeline.html").stat().st_size > 1_000_000
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folder left


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["profile", "--out", ""], ("--out is empty",)),
        (["profile", "--out", "/proc/p.json"], ("--out", "/proc", "cannot create a file")),
        (["profile", "--out", "{tmp}"], ("is a folder",)),
        (["profile", "--out", "{tmp}/p.json", "--steps", "0"], ("--steps 0",)),
        (["profile", "--out", "{tmp}/p.json", "--warmup", "-2"], ("--warmup -2",)),
        (["profile", "--out", "{tmp}/p.json", "--model", "gpt-9"], ("gpt-9",)),
        (["profile", "--out", "{tmp}/p.json", "--world-size", "10000"], ("world_size=10000",)),
        (["bandwidth", "--out", "/proc/b.json"], ("--out", "/proc", "cannot create a file")),
        (["bandwidth", "--html", "/proc/b.html"], ("--html", "/proc", "cannot create a file")),
        (["bandwidth", "--repeats", "0"], ("--repeats 0", "repeats must be a positive int")),
        (["bandwidth", "--max-size-mb", "inf"], ("--max-size-mb inf", "finite")),
        (["bandwidth", "--world-size", "10000"], ("world_size=10000", "cores")),
        (["bandwidth", "--out", "{tmp}/b", "--html", "{tmp}/b"], ("same file as --out",)),
        (["check", "--world-size", "0"], ("--world-size 0", "world_size must be")),
        (["check", "--world-size", "10000"], ("world_size=10000", "cores", "MB each")),
        (["simulate", "--model", "gpt-7m", "--json", "/proc/s.json"], ("--json", "/proc")),
        (["simulate", "--model", "gpt-7m", "--bucket-cap-mb", "1e-12"], ("1e-12", "0 bytes")),
        (["simulate", "--model", "gpt-7m", "--compute-speedup", "-2"], ("compute_speedup",)),
        (["doctor", "{tmp}/nothing-here"], ("nothing-here", "does not exist")),
        (["doctor", "{tmp}", "--current-cap-mb", "0"], ("--current-cap-mb", "> 0")),
        (["doctor", "{tmp}", "--ddp-logging-data", "{tmp}/no.json"], ("no.json",)),
        (["doctor", "{tmp}", "--html", "/proc/t.html"], ("--html", "/proc")),
        (["memory", "--world-size", "0"], ("world_size must be a positive int, got 0",)),
        (["memory", "--seq-len", "-1"], ("seq_len", "-1")),
    ],
    ids=lambda a: " ".join(a) if isinstance(a, list) else None,
)
def test_every_verb_refuses_bad_input_in_one_line_before_any_rank_starts(
    argv, needles, tmp_path, no_ranks, capsys
):
    """Before: profile, bandwidth and check started ranks (and profile and bandwidth measured)
    before finding an output they could not write; doctor and simulate died with tracebacks."""
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own refusal (a bad choice) is one line too
        rc = e.code
        err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
        assert len(err) == 1 and all(n in err[0] for n in needles), err
        assert rc == 2
        return
    assert rc == 2
    one_line_error(capsys, *needles)


def test_simulate_refuses_to_write_its_json_over_the_profile_it_reads(tmp_path, capsys):
    """Before: ``simulate --profile p.json --json p.json`` replaced the measured profile."""
    profile = tmp_path / "p.json"
    profile.write_bytes(PROFILE.read_bytes())
    for same in (str(profile), f"{tmp_path}/./p.json"):
        assert main(["simulate", "--profile", str(profile), "--json", same]) == 2
        one_line_error(capsys, "same file as --profile", "destroy")
        assert profile.read_bytes() == PROFILE.read_bytes()
    link = tmp_path / "link.json"
    os.link(profile, link)  # another name of the same file
    assert main(["simulate", "--profile", str(profile), "--json", str(link)]) == 2
    one_line_error(capsys, "same file as --profile")
    assert profile.read_bytes() == PROFILE.read_bytes()


def _replaced_whole(path: Path, run) -> None:
    """Run the command that writes ``path``; a reader holding the old file (a hard link) must
    still see all of the old file: the new one arrived by rename, not by rewriting in place.
    The new file follows the umask (027 here), as every other tool's output does."""
    path.write_text("OLD")
    reader = path.with_name(path.name + ".reader")
    os.link(path, reader)
    old_mask = os.umask(0o027)
    try:
        assert run() == 0
    finally:
        os.umask(old_mask)
    assert reader.read_text() == "OLD"
    assert path.read_text() != "OLD"
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    left = [p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}")]
    assert left == []


def test_simulate_json_is_written_atomically_with_the_umask(tmp_path, capsys):
    """Before: the JSON was rewritten in place (a reader or a kill saw half a file)."""
    out = tmp_path / "s.json"
    _replaced_whole(out, lambda: main(["simulate", "--model", "gpt-7m", "--json", str(out)]))
    assert json.loads(out.read_text())["best_bucket_cap_mb"] > 0


def test_profile_is_written_atomically_with_the_umask(tmp_path, monkeypatch, capsys):
    """Before: ``BackwardProfile.save`` rewrote the file in place. (The measurement itself is
    replaced by the saved profile: what is tested is how the verb writes it.)"""
    from dplab.cli import profile as verb

    monkeypatch.setattr(verb, "measure_profile", lambda *a, **k: BackwardProfile.load(PROFILE))
    out = tmp_path / "p.json"
    _replaced_whole(out, lambda: main(["profile", "--model", "gpt-7m", "--out", str(out)]))
    assert BackwardProfile.load(out).to_dict() == BackwardProfile.load(PROFILE).to_dict()


def test_bandwidth_outputs_are_written_atomically_with_the_umask(tmp_path, monkeypatch, capsys):
    """Before: ``--out`` was rewritten in place and ``--html`` by plotly's own open(). (The rows
    come from an α-β formula, not from ranks: what is tested is how the verb writes them.)"""
    from dplab.cli import bandwidth as verb
    from dplab.collectives.bench import BandwidthRow

    def rows(world_size, *, sizes, **_):
        return [
            BandwidthRow("all_reduce", world_size, s, 1e-5 + s * 1e-9, s / 1e4, s / 1e4, 1)
            for s in sizes
        ]

    monkeypatch.setattr(verb, "measure_bandwidth", rows)
    out, page = tmp_path / "b.json", tmp_path / "b.html"
    page.write_text("OLD")
    reader = tmp_path / "b.html.reader"
    os.link(page, reader)
    argv = ["bandwidth", "--max-size-mb", "0.0625", "--out", str(out), "--html", str(page)]
    _replaced_whole(out, lambda: main(argv))
    assert reader.read_text() == "OLD" and "Plotly.newPlot" in page.read_text()
    assert stat.S_IMODE(page.stat().st_mode) == 0o640
    assert json.loads(out.read_text())["rows"]
