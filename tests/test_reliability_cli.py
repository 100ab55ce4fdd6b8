"""Issue 20, the widget, simulator and command-line half: bad input is refused at once, naming
the bad value and the cause; no verb measures first and checks after; no output destroys an
input or is left half-written; a widget whose pool died restarts it.

Each test failed on the code before the fix (the commit this file was written against), and
says in its docstring how. Where ranks must not start, ``no_ranks`` makes starting one an
error, so a verb that still measured before checking fails here at once instead of after a
minute of measuring.
"""

from __future__ import annotations

import json
import math
import os
import signal
import stat
import time
from pathlib import Path

import pytest

from dplab.cli import main
from dplab.ddp.buckets import bucket_plan
from dplab.launch import Cluster
from dplab.models import make_model
from dplab.sim import BackwardProfile, Link, simulate
from dplab.sim.engine import candidate_caps, schedule
from dplab.sim.link import ASSETS
from dplab.trace import load_run
from dplab.trace.files import save_run
from tests.conftest import child_pids

PROFILE = ASSETS / "profile_gpt-7m.json"
COMMITTED_RUN = ASSETS / "traces" / "tiny-gpt-2ranks-cap5"
FAULT_BOUND_S = 30.0  # the bound from the fault to the error


def _no_rank_may_start(self) -> None:
    raise AssertionError("a rank process was started before the arguments were checked")


@pytest.fixture
def no_ranks(monkeypatch):
    """Starting a rank process is a test failure (checked before anything is measured)."""
    monkeypatch.setattr(Cluster, "_start", _no_rank_may_start)


def one_line_error(capsys, *needles: str) -> str:
    """stderr is one line, ``error: ...``, holding every needle (the flag, the value, why)."""
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


# -- item 11: every verb checks its arguments and outputs before it starts a rank ---------------


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
    monkeypatch.setattr(Cluster, "_start", _no_rank_may_start)
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


# -- item 12: an output never destroys an input, and is written whole ----------------------------


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


# -- item 8 and 13d: the simulator refuses what it cannot time, at once ------------------------


class _Alarm(Exception):
    pass


@pytest.fixture
def alarm():
    """Interrupt the test after 10 s (the old simulator looped forever on these inputs)."""

    def ring(*_):
        raise _Alarm("still running after 10 s")

    old = signal.signal(signal.SIGALRM, ring)
    t0 = time.monotonic()
    pending, _ = signal.setitimer(signal.ITIMER_REAL, 10.0)  # pytest-timeout's, if it set one
    yield
    signal.setitimer(signal.ITIMER_REAL, 0.0)
    signal.signal(signal.SIGALRM, old)
    if pending:
        signal.setitimer(signal.ITIMER_REAL, max(pending - (time.monotonic() - t0), 0.001))


@pytest.mark.parametrize(("alpha_s", "bandwidth_Bps"), [(1e306, 1e-300), (0.0, 1e-300)])
def test_a_link_whose_all_reduce_overflows_is_refused_within_a_second(
    alpha_s, bandwidth_Bps, alarm
):
    """Before: bandwidth 1e-300 B/s with α 1e306 s made the schedule's event loop spin forever
    (inf - inf is nan, so no event was ever reached)."""
    profile = BackwardProfile.load(PROFILE)
    link = Link("slow", alpha_s, bandwidth_Bps)
    t0 = time.monotonic()
    with pytest.raises(ValueError) as e:
        simulate(profile, link=link, world_size=2)
    assert time.monotonic() - t0 < 1.0
    text = str(e.value)
    assert "'slow'" in text and f"bandwidth_Bps={bandwidth_Bps!r}" in text
    assert "bucket 0" in text and "out of any real range" in text


def test_a_huge_but_finite_link_still_simulates(alarm):
    """The negative control: a link that is slow but whose times fit in a float is simulated."""
    trace = simulate(BackwardProfile.load(PROFILE), link=Link("slow", 1e300, 1e3), world_size=2)
    assert math.isfinite(trace.metrics.t_step_ms) and trace.metrics.t_step_ms > 1e300


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"comm_ms": [math.inf, 1.0]}, "comm_ms[0] must be a finite number of ms >= 0, got inf"),
        ({"comm_ms": [1.0, math.nan]}, "comm_ms[1] must be a finite number of ms >= 0, got nan"),
        ({"comm_ms": [1e308, 1e308]}, "the step's times overflow"),
        ({"backward_ms": math.inf}, "backward_ms must be a finite number >= 0, got inf"),
        ({"prep_ms": [0.0, -1.0]}, "prep_ms[1] must be a finite number of ms >= 0, got -1.0"),
    ],
)
def test_the_schedule_refuses_times_it_cannot_add(kwargs, needle, alarm):
    """Before: the same inputs given to ``schedule`` directly looped forever or returned nan."""
    args = {"ready": [1.0, 2.0], "backward_ms": 3.0, "comm_ms": [1.0, 1.0], **kwargs}
    with pytest.raises(ValueError) as e:
        schedule(args["ready"], args["backward_ms"], args["comm_ms"], prep_ms=args.get("prep_ms"))
    assert needle in str(e.value)


@pytest.mark.parametrize(
    ("low_mb", "needle"),
    [
        (0, "low_mb must be > 0 MiB, got 0"),
        (-1.0, "low_mb must be > 0 MiB, got -1.0"),
        (math.nan, "low_mb must be a finite number of MiB, got nan"),
        (1e-12, "low_mb=1e-12 is 0 bytes"),
    ],
)
def test_candidate_caps_names_a_bad_low_mb(low_mb, needle):
    """Before: ``candidate_caps(low_mb=0)`` said "math domain error"."""
    with pytest.raises(ValueError) as e:
        candidate_caps(BackwardProfile.load(PROFILE), low_mb=low_mb)
    assert needle in str(e.value)


# -- item 5: MemoryWall never draws a model other than the one asked for ------------------------


@pytest.mark.parametrize(("n_params", "clamped"), [(1e13, "1e+12"), (5e6, "1e+08")])
def test_memory_wall_refuses_a_parameter_count_its_slider_would_clamp(n_params, clamped):
    """Before: ``MemoryWall(model="custom", n_params=1e13)`` drew a 1e12-parameter model."""
    from dplab.widgets.memory import MemoryWall

    with pytest.raises(ValueError) as e:
        MemoryWall(model="custom", n_params=n_params)
    text = str(e.value)
    assert f"n_params={n_params:g}" in text and "1e+08..1e+12" in text and clamped in text
    wall = MemoryWall(model="custom", n_params=2e11)  # inside the range: drawn as asked
    assert wall.fit.n_params == 2 * 10**11


# -- item 9b: SweepRunner refuses a world size the machine cannot hold -------------------------


def test_sweep_runner_refuses_more_ranks_than_the_machine_holds(no_ranks):
    """Before: ``SweepRunner(world_size=10000)`` was accepted (its run would start them)."""
    from dplab.widgets.sweep_runner import SweepRunner

    t0 = time.monotonic()
    with pytest.raises(ValueError) as e:
        SweepRunner(world_size=10_000, simulate=False)
    assert time.monotonic() - t0 < 1.0
    text = str(e.value)
    assert "world_size=10000" in text and "cores" in text and "oversubscribe=True" in text
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        SweepRunner(world_size=0, simulate=False)
    big = SweepRunner(world_size=10_000, simulate=False, oversubscribe=True)  # nothing runs yet
    assert big.world_size == 10_000
    big.close()


# -- items 4 and 1c: BucketExplorer re-measures every new cap and restarts a dead pool ----------


def _expected_buckets(model: str, cap: float) -> int:
    rows = [
        (n, p.numel(), p.numel() * 4, "f32")
        for n, p in reversed(list(make_model(model).named_parameters()))
    ]
    return len(bucket_plan(rows, bucket_cap_mb=cap, first_bucket_cap_mb=min(cap, 1.0)))


def test_a_cap_below_every_slider_stop_is_measured(cluster2):
    """Before: ``set_bucket_cap(0.005)`` showed "0.005 MiB" and never re-measured: the new
    option became the slider's first, the value was already 0.005, and no change event came."""
    from dplab.widgets.bucket_explorer import BucketExplorer

    ex = BucketExplorer(cluster2, model="mlp", bucket_cap_mb=1.0, batch_size=2)
    try:
        assert _expected_buckets("mlp", 0.005) != _expected_buckets("mlp", 1.0)
        before = ex.traces
        ex.set_bucket_cap(0.005)
        assert ex.message == "" and ex.bucket_cap_mb == 0.005
        assert ex.traces is not before and ex.traces[0].meta["bucket_cap_mb"] == 0.005
        assert ex.n_buckets == _expected_buckets("mlp", 0.005)
        kept = ex.traces
        ex.set_bucket_cap(1e-12)
        assert all(s in ex.message for s in ("bucket cap", "1e-12", "0 bytes", "at least 1 byte"))
        assert "kept 0.005 MiB" in ex.message and ex.traces is kept
    finally:
        ex.close()


def test_bucket_explorer_restarts_a_pool_whose_rank_died(capsys):
    """Before: the widget said "a stopped pool is restarted" but never restarted the pool it
    was given (first: a bare BrokenPipeError from the dead pool; with ``alive`` truthful: a
    different, new pool, while the notebook's own stayed dead)."""
    import dplab
    from dplab.widgets.bucket_explorer import BucketExplorer

    before = child_pids()
    with dplab.Cluster(2, backend="gloo") as shared:
        ex = BucketExplorer(shared, model="mlp", bucket_cap_mb=1.0, batch_size=2)
        try:
            pids = shared.run(os.getpid)
            os.kill(pids[1], signal.SIGKILL)
            t0 = time.monotonic()
            while shared.alive and time.monotonic() - t0 < FAULT_BOUND_S:
                time.sleep(0.01)
            assert not shared.alive
            old = ex.traces
            ex.set_bucket_cap(0.25)
            assert ex.message == "", ex.message
            assert time.monotonic() - t0 < FAULT_BOUND_S
            assert ex.cluster is shared and shared.alive  # restarted in place, usable again
            assert ex.traces is not old and ex.n_buckets == _expected_buckets("mlp", 0.25)
            assert sorted(shared.run(os.getpid)) != sorted(pids)  # fresh processes
        finally:
            ex.close()
    assert child_pids() <= before


# -- item 13c: DDP names a bucket cap that is 0 bytes ------------------------------------------


def test_ddp_names_a_bucket_cap_of_zero_bytes():
    """Before: "limits must be positive byte counts, got [1048576, 0]"."""
    from dplab.ddp.buckets import bucket_plan as plan

    rows = [("w", 10, 40, "f32")]
    with pytest.raises(ValueError) as e:
        plan(rows, bucket_cap_mb=1e-12, first_bucket_cap_mb=1.0)
    assert "bucket_cap_mb=1e-12 is 0 bytes" in str(e.value)
    assert "at least 1 byte" in str(e.value)


# -- item 13e: one Tracer handed to two DDPs -------------------------------------------------------


def _two_ddps_one_tracer() -> str:
    import torch

    import dplab

    tracer = dplab.Tracer()
    first = dplab.DDP(torch.nn.Linear(4, 4), tracer=tracer)  # still in use
    try:
        dplab.DDP(torch.nn.Linear(4, 4), tracer=tracer)
    except ValueError as e:
        return str(e)
    return f"accepted beside {type(first).__name__}"


def test_a_tracer_given_to_a_second_ddp_is_refused_by_name():
    """Before: accepted, then an IndexError inside a grad hook of the first DDP's backward."""
    from dplab.launch import launch

    messages = launch(_two_ddps_one_tracer, 2, timeout_s=120)
    for message in messages:
        assert "already records another dplab.DDP" in message
        assert "its own Tracer" in message
