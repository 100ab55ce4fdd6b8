"""Issue 27, hostile run folders and traces: every loader refuses what is not a trace in one line.

A run folder or a trace folder may come from a colleague, a crashed job or a downloaded archive,
so the loaders must not trust it: before the fix a cut ``.json.gz`` gave a bare
``EOFError``/``zlib.error``, a ``run.json`` whose rank file is ``/dev/zero`` read until memory ran
out, a FIFO named ``rank1.json`` blocked forever, NaN span times and ``world_size: 0`` loaded
without a word, and other bad fields gave raw KeyError/TypeError/IndexError/RecursionError/
UnicodeDecodeError. Now each is a ``ValueError`` (or ``FileNotFoundError``) naming the file and
the problem, within a second. Every test is guarded by an alarm so a loader that blocks fails
the test instead of hanging it.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from dplab.trace import load_rank, load_run
from dplab.trace.files import MAX_RANK_FILE_BYTES, read_json_file, save_run
from dplab.trace.profiler import from_profiler

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "traces"
COMMITTED_RUN = ASSETS / "tiny-gpt-2ranks-cap5"  # an old-format run (no run.json)
TORCH_TRACES = ASSETS / "torch-ddp-tiny-gpt-2ranks-cap0.5"
BOUND_S = 5  # a loader that takes longer than this on a hostile file is hanging or flooding


class _Hung(Exception):
    pass


@pytest.fixture(autouse=True)
def alarm():
    """Fail (not hang) if a loader blocks: SIGALRM after BOUND_S seconds."""

    def ring(signum, frame):
        raise _Hung(f"the loader did not return within {BOUND_S} s")

    old = signal.signal(signal.SIGALRM, ring)
    signal.alarm(BOUND_S)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def refused(fn, *needles: str, kind: type[Exception] = ValueError) -> str:
    """``fn()`` raises ``kind`` (never a raw decoder error) within BOUND_S, with every needle."""
    t0 = time.monotonic()
    with pytest.raises(kind) as info:
        fn()
    assert time.monotonic() - t0 < BOUND_S
    text = str(info.value)
    assert "\n" not in text.strip(), text
    for needle in needles:
        assert needle in text, (needle, text)
    return text


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """A complete run folder with a manifest (the committed run, saved again)."""
    out = tmp_path / "run"
    save_run(load_run(COMMITTED_RUN), out, {"command": "test"})
    return out


DEEP = "@deep@"  # stands for a list nested 100 000 deep, which json.dumps cannot write


def _edit_rank(folder: Path, rank: int, edit) -> None:
    path = folder / f"rank{rank}.json"
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc).replace(f'"{DEEP}"', "[" * 100_000 + "]" * 100_000))


def test_the_committed_runs_still_load(run_dir):
    """The control: a good folder and the committed traces load (the checks refuse only bad)."""
    assert [len(r) for r in load_run(run_dir)] == [len(r) for r in load_run(COMMITTED_RUN)]
    assert len(from_profiler(TORCH_TRACES)) == 2


# -- profiler traces: .json.gz cut short or damaged -----------------------------------------------


@pytest.mark.parametrize("damage", ["truncated", "corrupt"])
def test_a_damaged_gz_trace_is_one_value_error_naming_the_file(tmp_path, damage):
    """Before: ``EOFError: Compressed file ended before the end-of-stream marker was reached``
    (truncated) or ``zlib.error`` (corrupt) through ``from_profiler``."""
    folder = tmp_path / "traces"
    shutil.copytree(TORCH_TRACES, folder)
    bad = folder / "rank1.pt.trace.json.gz"
    data = bad.read_bytes()
    if damage == "truncated":
        bad.write_bytes(data[: len(data) // 2])
    else:
        bad.write_bytes(data[:40] + bytes(b ^ 0x5A for b in data[40:400]) + data[400:])
    refused(lambda: from_profiler(folder), "rank1.pt.trace.json.gz", "gzip")


def test_a_gz_that_unpacks_past_the_cap_is_refused_without_unpacking_it(tmp_path):
    """Before: a small .gz of a huge document was unpacked whole into memory."""
    bomb = tmp_path / "bomb.json.gz"
    with gzip.open(bomb, "wb") as f:
        for _ in range(3):
            f.write(b" " * (1 << 20))
    refused(lambda: read_json_file(bomb, 2 << 20), "bomb.json.gz", "unpacks to more than")


# -- run folders: where run.json points, FIFOs, devices, sizes ------------------------------------


def test_a_manifest_that_points_a_rank_at_dev_zero_is_refused(run_dir):
    """Before: ``load_run`` read /dev/zero until memory ran out."""
    path = run_dir / "run.json"
    manifest = json.loads(path.read_text())
    manifest["ranks"]["1"] = "/dev/zero"
    path.write_text(json.dumps(manifest))
    refused(lambda: load_run(run_dir), "run.json", "'/dev/zero'", "rank{r}.json")


@pytest.mark.parametrize("where", ["manifest run", "old-format run"])
def test_a_fifo_named_rank1_json_is_refused_not_waited_on(tmp_path, run_dir, where):
    """Before: open() of the FIFO blocked forever (no writer ever comes)."""
    folder = run_dir if where == "manifest run" else tmp_path / "old"
    if folder != run_dir:
        shutil.copytree(COMMITTED_RUN, folder)
    (folder / "rank1.json").unlink()
    os.mkfifo(folder / "rank1.json")
    refused(lambda: load_run(folder), "rank1.json", "FIFO")


def test_a_device_posing_as_a_rank_file_is_refused(tmp_path):
    """Before: ``load_rank`` on a symlink to /dev/zero read until memory ran out."""
    link = tmp_path / "rank0.json"
    link.symlink_to("/dev/zero")
    refused(lambda: load_rank(link), "rank0.json", "character device")


def test_a_rank_file_beyond_the_cap_is_refused_before_reading(run_dir):
    """Before: read whole, however large (a sparse file costs no disk here)."""
    path = run_dir / "rank1.json"
    with open(path, "r+b") as f:
        f.truncate(MAX_RANK_FILE_BYTES + 1)
    refused(lambda: load_run(run_dir), "rank1.json", f"{MAX_RANK_FILE_BYTES:,}")


# -- fields: every bad value named, never a raw error ---------------------------------------------


def _nan_start(doc):
    doc["steps"][0]["spans"][0]["start_ms"] = float("nan")


def _set(key, value):
    def edit(doc):
        doc["steps"][0][key] = value

    return edit


def _span(key, value):
    def edit(doc):
        doc["steps"][0]["spans"][0][key] = value

    return edit


def _deep(doc):
    doc["steps"][0]["spans"] = DEEP


BAD_FIELDS = [
    ("nan span time", _nan_start, ("rank0.json", "finite")),
    ("inf span time", _span("end_ms", float("inf")), ("rank0.json", "finite")),
    ("span ends before it starts", _span("end_ms", -1e9), ("rank0.json", "ends before")),
    ("world_size 0", _set("world_size", 0), ("rank0.json", "world_size", "got 0")),
    ("steps not a list", lambda d: d.update(steps="x"), ("rank0.json", "'steps'")),
    ("no steps", lambda d: d.update(steps=[]), ("rank0.json", "'steps'")),
    ("spans nested 100000 deep", _deep, ("rank0.json",)),
    ("run not a dict", lambda d: d.update(run=[1]), ("rank0.json", "mixes files")),
]


@pytest.mark.parametrize(
    ("edit", "needles"), [c[1:] for c in BAD_FIELDS], ids=[c[0] for c in BAD_FIELDS]
)
def test_a_bad_field_in_a_rank_file_is_named(run_dir, edit, needles):
    """Before: NaN and infinite times, a span ending before it starts and world_size 0 loaded;
    the others raised a raw TypeError, AttributeError or RecursionError. (Fields from_dict
    already named, a text start_ms or a span without a name, are not repeated here.)"""
    _edit_rank(run_dir, 0, edit)
    refused(lambda: load_run(run_dir), *needles)


def test_world_size_0_in_an_old_format_folder_is_named(tmp_path):
    """Before: every step said world size 0, no rank was missing, and the folder loaded."""
    folder = tmp_path / "old"
    shutil.copytree(COMMITTED_RUN, folder)
    (folder / "rank1.json").unlink()
    _edit_rank(folder, 0, lambda d: [s.update(world_size=0) for s in d["steps"]])
    refused(lambda: load_run(folder), "rank0.json", "world_size")


MANIFEST_FIELDS = [
    ("world_size 0", lambda m: m.update(world_size=0), ("world_size", "got 0")),
    ("world_size text", lambda m: m.update(world_size="2"), ("world_size", "'2'")),
    ("world_size huge", lambda m: m.update(world_size=10**12), ("world_size",)),
    ("no run_id", lambda m: m.pop("run_id"), ("run_id",)),
    ("ranks a list", lambda m: m.update(ranks=["rank0.json"]), ("ranks",)),
    ("rank elsewhere", lambda m: m["ranks"].update({"0": "../x/rank0.json"}), ("ranks",)),
]


@pytest.mark.parametrize(
    ("edit", "needles"), [c[1:] for c in MANIFEST_FIELDS], ids=[c[0] for c in MANIFEST_FIELDS]
)
def test_a_bad_field_in_run_json_is_named(run_dir, edit, needles):
    """Before: KeyError ('run_id', '0'), TypeError, or ``world_size: 0`` loading as no ranks."""
    path = run_dir / "run.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))
    refused(lambda: load_run(run_dir), "run.json", *needles)


def test_a_rank_file_that_is_not_utf8_is_named(run_dir):
    """Before: a raw UnicodeDecodeError."""
    (run_dir / "rank1.json").write_bytes(b'{"format": "\xff\xfe"}')
    refused(lambda: load_run(run_dir), "rank1.json", "UTF-8")
