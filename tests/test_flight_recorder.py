"""The flight-recorder reader: which rank is behind, at which collective, checked on real hangs.

Real hangs run as fresh 2-rank gloo jobs (``dplab.failures.job``) whose default group times out
in one second; each rank dumps torch's flight record into one folder. The verdict is checked
against the planted bug (who skipped which collective) and against torch's own reader,
``torchfrtrace``, on a copy of the dumps whose ``pg_config`` names the groups (torch 2.13's
torchfrtrace raises ``KeyError`` on the raw gloo dumps, which is checked too). The rules of the
reading are checked on dumps built here, in torch's format, where the truth is known by
construction: more ranks, a ring buffer that forgot the oldest entries, a rank that skipped one
collective and went on.
"""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest

from dplab.doctor.flight_recorder import analyze, read_dumps, read_flight_recorder
from dplab.doctor.frtrace import fixed_up_copy, torchfrtrace_verdicts
from dplab.doctor.nccl_log import RECORDED_HANG, RECORDED_LOG, read_nccl_log
from dplab.failures.job import DUMP_PREFIX, run_job
from tests.conftest import child_pids

SHORT_S = 1.0


def entry(seq: int, sizes: list[int] | None, *, op: str = "all_reduce", group: str = "0",
          record: int = 0) -> dict:  # fmt: skip
    """One entry as torch 2.13 writes it (the fields the readers use)."""
    shapes = [] if sizes is None else [sizes]
    return {
        "record_id": record,
        "pg_id": int(group),
        "process_group": (group, "undefined"),
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "op_id": seq,
        "profiling_name": f"gloo:{op}",
        "time_created_ns": 1000 * record + seq,
        "input_sizes": shapes,
        "output_sizes": shapes,
        "input_dtypes": ["Float"] * len(shapes),
        "output_dtypes": ["Float"] * len(shapes),
        "state": "scheduled",
        "is_p2p": False,
        "retired": True,
        "timeout_ms": 1000,
        "frames": [{"name": "train_step", "filename": "/job/train.py", "line": 7}],
    }


def dump(*entries: dict) -> dict:
    return {
        "version": "2.10",
        "pg_config": {"": {"name": "", "desc": "", "ranks": "[]"}},
        "pg_status": {},
        "entries": [{**e, "record_id": i} for i, e in enumerate(entries)],
    }


def sizes_dump(*sizes: int, start: int = 1) -> dict:
    return dump(*(entry(start + i, [n]) for i, n in enumerate(sizes)))


def test_a_rank_with_no_record_of_a_collective_never_issued_it():
    m = analyze({0: sizes_dump(3, 4, 5), 1: sizes_dump(3, 4)}).first
    assert (m.behind, m.seq, m.kind) == ((1,), 3, "never issued")
    assert m.reference.what() == "all_reduce [5]"


@pytest.mark.parametrize("skipper", [0, 1])
def test_a_rank_that_skipped_one_and_went_on_is_named_whichever_it_is(skipper):
    # every rank logs the loss [4]; the others also all-reduce a metric [1] at #2; all go on
    full, skipped = sizes_dump(4, 1, 4), sizes_dump(4, 4)
    dumps = {r: skipped if r == skipper else full for r in range(2)}
    m = analyze(dumps).first
    assert (m.behind, m.seq, m.kind) == ((skipper,), 2, "never issued")


def test_the_odd_rank_out_of_three_is_named_and_one_against_one_is_a_tie():
    three = analyze({0: sizes_dump(4, 3), 1: sizes_dump(4, 2), 2: sizes_dump(4, 3)}).first
    assert (three.behind, three.seq, three.kind, three.tie) == (
        (1,),
        2,
        "issued differently",
        False,
    )
    two = analyze({0: sizes_dump(4, 3), 1: sizes_dump(4, 2)}).first
    assert (two.behind, two.tie) == ((1,), True)  # torchfrtrace's convention: differs from rank 0
    assert (
        "cannot say which side is wrong"
        in analyze({0: sizes_dump(4, 3), 1: sizes_dump(4, 2)}).summary()
    )


def test_a_ring_buffer_that_forgot_the_oldest_is_lined_up_by_number():
    # rank 0 kept #3..#5, rank 1 #2..#4: #3 and #4 agree, rank 1 never issued #5
    m = analyze({0: sizes_dump(5, 6, 7, start=3), 1: sizes_dump(4, 5, 6, start=2)}).first
    assert (m.behind, m.seq) == ((1,), 5)


def test_matching_records_say_no_rank_is_behind():
    report = analyze({0: sizes_dump(3, 4), 1: sizes_dump(3, 4)})
    assert report.first is None
    assert "behind: none" in report.summary()


def test_groups_are_read_apart_and_a_listed_member_without_a_dump_is_refused():
    both = dump(entry(1, [3]), entry(1, [8], group="1"), entry(2, [9], group="1"))
    one = dump(entry(1, [3]), entry(1, [8], group="1"))
    m = analyze({0: both, 1: one}).first
    assert (m.group, m.behind, m.seq) == ("1", (1,), 2)
    listed = {**one, "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2]"}}}
    with pytest.raises(ValueError, match=r"no dump of rank\(s\) \[2\]"):
        analyze({0: both, 1: listed})


def test_bad_folders_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        read_dumps(tmp_path / "nowhere")
    (tmp_path / "a_0").write_bytes(pickle.dumps(sizes_dump(3)))
    (tmp_path / "b_1").write_bytes(pickle.dumps(sizes_dump(3)))
    with pytest.raises(ValueError, match="prefixes found"):
        read_dumps(tmp_path)
    (tmp_path / "b_1").unlink()
    (tmp_path / "a_1").write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="a_1 is not a flight-recorder dump"):
        read_dumps(tmp_path)


def test_the_cli_refuses_a_folder_that_is_not_there(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "dplab", "doctor", "--flight-recorder", str(tmp_path / "x")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "does not exist" in done.stderr, done.stderr


PLANTED = [
    {"skipper": 1, "position": 1, "new_group": False},
    {"skipper": 0, "position": 3, "new_group": False},
    {"skipper": 0, "position": 1, "new_group": True},
    {"skipper": 1, "position": 2, "new_group": True},
]


@pytest.mark.parametrize(
    "planted", PLANTED, ids=lambda p: "{skipper}-{position}-{new_group}".format(**p)
)
def test_a_planted_skip_is_named_and_torchfrtrace_agrees(tmp_path, planted):
    before = child_pids()
    run = run_job("skip", folder=tmp_path / "fr", timeout_s=SHORT_S, **planted)
    assert child_pids() <= before, "no rank left behind"
    skipper, position = planted["skipper"], planted["position"]
    assert run.errors[skipper] is None and "Timed out" in run.errors[1 - skipper]
    assert sorted(p.name for p in (tmp_path / "fr").iterdir()) == [
        f"{DUMP_PREFIX}0",
        f"{DUMP_PREFIX}1",
    ]
    m = read_flight_recorder(tmp_path / "fr").first
    assert (m.behind, m.seq, m.kind) == ((skipper,), position, "never issued"), m
    with pytest.raises(KeyError):  # torch 2.13's torchfrtrace on the raw gloo dumps
        torchfrtrace_verdicts(tmp_path / "fr")
    theirs = torchfrtrace_verdicts(fixed_up_copy(tmp_path / "fr", tmp_path / "fixed"))
    assert [(v.seq, v.group, v.ranks, v.kind) for v in theirs] == [
        (position, m.group, (skipper,), "missing")
    ]
    done = subprocess.run(
        [sys.executable, "-m", "dplab", "doctor", "--flight-recorder", str(tmp_path / "fr")],
        capture_output=True,
        text=True,
    )
    behind = [line for line in done.stdout.splitlines() if line.startswith("behind:")]
    assert done.returncode == 0 and len(behind) == 1, done.stdout + done.stderr
    assert f"rank {skipper} never issued collective #{position} " in behind[0], behind


def test_the_lesson_hangs_are_read_as_the_lesson_says(tmp_path):
    one = run_job("metric_on_rank0", folder=tmp_path / "one", timeout_s=SHORT_S)
    assert "Timed out" in one.errors[0] and one.errors[1] is None
    m = read_flight_recorder(tmp_path / "one").first
    assert (m.behind, m.seq, m.reference.what()) == ((1,), 2, "all_reduce [1]")

    keys = run_job("metric_keys", folder=tmp_path / "keys", timeout_s=SHORT_S)
    assert any(g in (keys.errors[0] or "") for g in ("Timed out", "Connection closed by peer"))
    m = read_flight_recorder(tmp_path / "keys").first
    assert (m.seq, m.kind, m.tie) == (2, "issued differently", True)
    assert {c.what() for c in m.calls.values()} == {"all_reduce [3]", "all_reduce [2]"}
    theirs = torchfrtrace_verdicts(fixed_up_copy(tmp_path / "keys", tmp_path / "keys_fixed"))
    assert [(v.seq, v.kind) for v in theirs] == [(2, "SIZE_OR_SYNTAX_MISMATCH")]

    save = run_job("save_on_rank0", folder=tmp_path / "save", timeout_s=SHORT_S)
    assert gave_up_at_the_hang(save.errors), save.errors
    report = read_flight_recorder(tmp_path / "save")
    assert report.first.seq == 2 and report.last[0].op == "barrier"
    assert report.last[0].where.startswith("save_checkpoint")
    fixed = run_job("save_on_rank0", folder=tmp_path / "saved", timeout_s=SHORT_S, fixed=True)
    assert fixed.errors == [None, None]
    assert read_flight_recorder(tmp_path / "saved").first is None


def gave_up_at_the_hang(errors: list) -> bool:
    """Both ranks wait at the same collective with the same timeout: the first to reach it raises
    gloo's "Timed out"; its partner, if still waiting, sees "Connection closed by peer" as that
    rank exits (which of the two comes first is a race)."""
    gave_up = ("Timed out", "Connection closed by peer")
    return any("Timed out" in (e or "") for e in errors) and all(
        e is not None and any(g in e for g in gave_up) for e in errors
    )


def test_a_job_refuses_a_folder_with_files_and_an_unknown_scenario(tmp_path):
    (tmp_path / "old").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        run_job("skip", folder=tmp_path, skipper=0, position=1)
    with pytest.raises(ValueError, match="scenario"):
        run_job("nap", folder=tmp_path / "new")


def test_the_recorded_nccl_hang_reads_the_same_in_its_log_its_dump_and_torchfrtrace():
    log = read_nccl_log(RECORDED_LOG.read_text())
    assert [(t.seq, t.op, t.numel_in, t.timeout_ms) for t in log.timeouts] == [
        (4, "ALLREDUCE", 12345, 5000)
    ]
    assert [(s.seq, s.last_enqueued, s.last_completed) for s in log.statuses] == [(4, 4, 3)]
    assert log.transport == ["NET/IB : No device found", "Using network Socket"]
    report = read_flight_recorder(RECORDED_HANG)
    assert report.assumed == [] and report.members == {
        "0": (0,),
        "1": (0,),
    }  # NCCL lists its groups
    assert report.first is None and report.backend == "nccl"
    last = report.last[0]
    assert (last.seq, last.what(), last.state) == (4, "all_reduce [12345]", "scheduled")
    assert torchfrtrace_verdicts(RECORDED_HANG) == []  # one rank: nothing unmatched, as ours
