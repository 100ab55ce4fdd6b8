"""Run folders (``dplab.trace.save_run`` / ``load_run``): what is written is what is read back.

A folder written twice holds the second run only; a missing rank or a stray copy is named;
files of two runs in one folder are refused; old folders load only when they are one run;
someone else's files are never replaced; files follow the umask (docs/reliability.md).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import dplab
from dplab.trace import load_run

CLOCK = "host"


def _steps(world_size: int, tag: str) -> list[list[dplab.StepTrace]]:
    from dplab.trace import Span

    return [
        [
            dplab.StepTrace(
                rank=r,
                world_size=world_size,
                backend="gloo",
                device="cpu",
                clock=CLOCK,
                step=0,
                spans=[Span(tag, "forward", 0.0, 1.0 + r)],
            )
        ]
        for r in range(world_size)
    ]


def test_a_folder_written_twice_holds_the_second_run_only(tmp_path):
    from dplab.trace import save_run

    out = tmp_path / "run"
    save_run(_steps(4, "first"), out)
    with pytest.raises(FileExistsError, match="already holds a run"):
        save_run(_steps(2, "second"), out)
    save_run(_steps(2, "second"), out, overwrite=True)
    loaded = load_run(out)
    assert [s[0].rank for s in loaded] == [0, 1]
    assert {s[0].world_size for s in loaded} == {2}
    assert not (out / "rank2.json").exists()


def test_a_missing_rank_and_a_stray_copy_are_named(tmp_path):
    from dplab.trace import save_run

    save_run(_steps(2, "a"), tmp_path / "run")
    (tmp_path / "run" / "rank0 (copy).json").write_text((tmp_path / "run/rank0.json").read_text())
    assert [s[0].rank for s in load_run(tmp_path / "run")] == [0, 1]  # the copy is no rank
    (tmp_path / "run" / "rank1.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"rank1\.json is missing.*world size 2"):
        load_run(tmp_path / "run")


def test_files_of_two_runs_in_one_folder_are_refused(tmp_path):
    from dplab.trace import save_run

    save_run(_steps(2, "old"), tmp_path / "old")
    save_run(_steps(2, "new"), tmp_path / "new")
    # a kill between per-file renames: the new rank0 beside the old rank1
    (tmp_path / "new" / "rank1.json").write_text((tmp_path / "old" / "rank1.json").read_text())
    with pytest.raises(ValueError, match="mixes files of different runs"):
        load_run(tmp_path / "new")


def _legacy_folder(folder: Path, world_size: int, ranks, meta: dict) -> None:
    folder.mkdir(exist_ok=True)
    for steps in _steps(world_size, "x"):
        if steps[0].rank in ranks:
            doc = {"format": "dplab.run/1", "rank": steps[0].rank, "meta": meta}
            doc["steps"] = [s.to_dict() for s in steps]
            (folder / f"rank{steps[0].rank}.json").write_text(json.dumps(doc))


def test_old_folders_without_run_ids_load_only_when_they_are_one_run(tmp_path):
    _legacy_folder(tmp_path / "ok", 2, {0, 1}, {"date": "1"})
    assert len(load_run(tmp_path / "ok")) == 2
    _legacy_folder(tmp_path / "twice", 4, {0, 1, 2, 3}, {"date": "1"})
    _legacy_folder(tmp_path / "twice", 2, {0, 1}, {"date": "2"})
    with pytest.raises(ValueError, match=r"world sizes \[2, 4\]"):
        load_run(tmp_path / "twice")
    _legacy_folder(tmp_path / "hole", 4, {0, 2, 3}, {"date": "1"})
    with pytest.raises(ValueError, match=r"rank1\.json are missing"):
        load_run(tmp_path / "hole")
    _legacy_folder(tmp_path / "mixed", 2, {0, 1}, {"date": "1"})
    _legacy_folder(tmp_path / "mixed", 2, {1}, {"date": "2"})
    with pytest.raises(ValueError, match="different runs"):
        load_run(tmp_path / "mixed")
    recorded = Path(__file__).parents[1] / "assets" / "traces" / "tiny-gpt-2ranks-cap5"
    assert [s[0].rank for s in load_run(recorded)] == [0, 1]


def test_a_folder_holding_someone_elses_files_is_never_replaced(tmp_path):
    from dplab.trace import save_run

    (tmp_path / "trace.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a dplab run"):
        save_run(_steps(2, "a"), tmp_path, overwrite=True)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_run_files_follow_the_umask(tmp_path):
    from dplab.trace import save_run

    old = os.umask(0o022)
    try:
        paths = save_run(_steps(2, "a"), tmp_path / "run", extra_files={"timeline.html": "<p>"})
    finally:
        os.umask(old)
    assert paths["timeline"].read_text() == "<p>"
    for path in [*paths.values(), tmp_path / "run"]:
        want = 0o755 if path.is_dir() else 0o644
        assert path.stat().st_mode & 0o777 == want, path
