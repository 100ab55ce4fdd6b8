"""Trace files: one JSON per rank, one merged Chrome trace-event file that Perfetto opens.

A run folder holds exactly one run. :func:`save_run` writes every file into a temporary folder
beside the target and renames the folder into place whole, last of all a ``run.json`` manifest
(run id, world size, the file of each rank); every rank file repeats the run id. So a folder
written twice, or a kill half-way, can never mix the ranks of two runs, and :func:`load_run`
checks the files it reads are one run (ranks 0..N-1, each exactly once, one run id) and says
what is wrong otherwise. Files are written with the process umask, like any other tool's.

Folders written before the manifest existed (``assets/traces/``) load when they are
self-consistent: ranks 0..N-1, every step's world size N, the same metadata in every file.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import math
import os
import re
import shutil
import stat
import tempfile
import uuid
import zlib
from pathlib import Path
from typing import Any

from dplab._units import MIB
from dplab.trace.step import StepTrace, chrome_trace

RUN_FORMAT = "dplab.run/1"
MANIFEST = "run.json"
MANIFEST_FORMAT = "dplab.run-manifest/1"
RANK_FILE = re.compile(r"rank(0|[1-9][0-9]*)\.json")
# What save_run and the trace command put in a run folder; anything else is someone's data.
# what a run folder may hold: the traces, the manifest, and the pages and placement that the
# trace and cluster verbs add beside them
RUN_FILES = re.compile(r"rank\d+\.json|trace\.json|timeline(_nodes)?\.html|run\.json|cluster\.json")
EXTRA_FILES = ("timeline.html",)  # what a caller may add to a run folder beside the traces
# Caps on what a loader reads (bytes, after gunzip): a rank file of a 5-step run is ~16 KB and a
# manifest well under 1 KB, so these are thousands of times what dplab writes; above them the
# file is not a trace (a run.json pointing at /dev/zero would otherwise read until memory runs
# out). torch.profiler's own traces are larger; dplab.trace.profiler passes its own cap.
MAX_RANK_FILE_BYTES = 64 * MIB
MAX_MANIFEST_BYTES = 1 * MIB
MAX_WORLD_SIZE = 1 << 20  # more ranks than any real run: a manifest saying more is corrupt


def _umask() -> int:
    """The process umask, read without changing it where the OS allows."""
    with contextlib.suppress(OSError, ValueError, StopIteration), open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0o022)  # elsewhere the only way to read it is to set it, then put it back
    os.umask(mask)
    return mask


def write_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file and a rename (mode: 0666 & ~umask).

    ``mkstemp`` makes its file 0600, which would leave a shared trace readable by its owner only.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def check_run_folder(out_dir: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Refuse, before anything is measured, a folder ``save_run`` would not write.

    An empty or absent folder is fine. A folder holding a run is replaced only with
    ``overwrite=True``; a folder holding anything else (someone's ``trace.json``) never is.
    """
    out = Path(out_dir)
    if str(out_dir) == "":
        raise ValueError("out_dir is empty: name a folder for the run, e.g. runs/NAME/")
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out} exists and is not a folder")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not held:
        return out
    foreign = [name for name in held if not RUN_FILES.fullmatch(name)]
    if foreign or not any(RANK_FILE.fullmatch(n) or n == MANIFEST for n in held):
        shown = ", ".join(foreign or held)
        raise FileExistsError(
            f"{out} holds files that are not a dplab run ({shown}); choose another folder"
        )
    if not overwrite:
        raise FileExistsError(
            f"{out} already holds a run ({', '.join(held)}); a run folder holds one run: "
            "choose another folder or pass overwrite=True to replace it"
        )
    return out


def save_rank(
    steps: list[StepTrace],
    path: str | os.PathLike,
    meta: dict | None = None,
    *,
    run: dict | None = None,
) -> Path:
    """One rank's steps as ``{"format": "dplab.run/1", "rank", "meta", "steps", "run"}``."""
    if not steps:
        raise ValueError("no steps to save")
    doc: dict[str, Any] = {
        "format": RUN_FORMAT,
        "rank": steps[0].rank,
        "meta": dict(meta or {}),
        "steps": [s.to_dict() for s in steps],
    }
    if run is not None:
        doc["run"] = dict(run)
    return write_atomic(path, json.dumps(doc))


def save_run(
    steps_by_rank: list[list[StepTrace]],
    out_dir: str | os.PathLike,
    meta: dict | None = None,
    *,
    overwrite: bool = False,
    extra_files: dict[str, str] | None = None,
) -> dict[str, Path]:
    """``rank{r}.json`` per rank, ``trace.json`` (Chrome trace events) and ``run.json``.

    Written into a temporary folder that is renamed onto ``out_dir`` whole: readers see the
    old run or the new one, never a mix. ``out_dir`` must be empty or absent, or hold a run and
    ``overwrite=True`` (see :func:`check_run_folder`). ``extra_files`` (name → text, e.g.
    ``{"timeline.html": ...}``) go into the same folder, in the same rename.
    """
    out = check_run_folder(out_dir, overwrite=overwrite)
    extra = dict(extra_files or {})
    for name in extra:
        if name not in EXTRA_FILES:
            raise ValueError(f"extra_files may hold timeline.html only, got {name!r}")
    ranks = [steps[0].rank if steps else None for steps in steps_by_rank]
    if sorted(r for r in ranks if r is not None) != list(range(len(steps_by_rank))):
        raise ValueError(f"steps_by_rank must hold ranks 0..N-1 once each, got ranks {ranks}")
    world_size = len(steps_by_rank)
    run = {"id": uuid.uuid4().hex, "world_size": world_size}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        os.chmod(tmp, 0o777 & ~_umask())
        for steps in steps_by_rank:
            save_rank(steps, tmp / f"rank{steps[0].rank}.json", meta, run=run)
        merged = chrome_trace([s for steps in steps_by_rank for s in steps])
        merged["otherData"].update(meta or {})
        merged["otherData"]["run_id"] = run["id"]
        write_atomic(tmp / "trace.json", json.dumps(merged))
        for name, text in extra.items():
            write_atomic(tmp / name, text)
        manifest = {
            "format": MANIFEST_FORMAT,
            "run_id": run["id"],
            "world_size": world_size,
            "ranks": {str(r): f"rank{r}.json" for r in range(world_size)},
            "meta": dict(meta or {}),
        }
        write_atomic(tmp / MANIFEST, json.dumps(manifest))
        _replace_folder(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    paths = {f"rank{r}": out / f"rank{r}.json" for r in range(world_size)}
    paths["chrome"] = out / "trace.json"
    paths["manifest"] = out / MANIFEST
    paths.update({Path(name).stem: out / name for name in extra})
    return paths


def _replace_folder(new: Path, out: Path) -> None:
    """Put folder ``new`` where ``out`` is. An empty ``out`` is replaced by one rename; a run
    in ``out`` is moved aside first and removed after (restored if the second rename fails)."""
    try:
        os.rename(new, out)  # atomic; replaces an empty folder, fails on a non-empty one
        return
    except OSError:
        if not out.is_dir():
            raise
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.rename(out, old / out.name)
    try:
        os.rename(new, out)
    except BaseException:
        os.rename(old / out.name, out)
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


def _file_kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


def read_json_file(
    path: str | os.PathLike, max_bytes: int, *, what: str = "JSON file", hint: str = ""
) -> Any:
    """The JSON document in ``path`` (gunzipped when the name ends in ``.gz``), read safely.

    Every reader of a folder someone else may have made goes through here, because ``open`` and
    ``json.loads`` trust the file: a FIFO blocks the reader forever, ``/dev/zero`` reads until
    memory runs out, a cut ``.gz`` raises a bare ``EOFError``. So: only a regular file is read
    (opened non-blocking, checked with ``fstat`` on the open descriptor, so it cannot be swapped
    in between), at most ``max_bytes`` are read (before and after gunzip), and every way the
    bytes can fail to be JSON is one ``ValueError`` naming the file and the problem.
    ``hint`` is appended to the not-JSON message (what file was expected).
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise FileNotFoundError(f"no {what} at {path}") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot open the {what} ({e.strerror or e})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is {_file_kind(st.st_mode)}, not a {what}: refused")
        if st.st_size > max_bytes:
            raise ValueError(
                f"{path} is {st.st_size:,} bytes, more than the {max_bytes:,} a {what} may be: "
                "refused (not a trace dplab or torch.profiler writes)"
            )
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"{path} grew past {max_bytes:,} bytes while being read: refused")
    if path.name.endswith(".gz"):
        try:
            with gzip.GzipFile(fileobj=io.BytesIO(data)) as g:
                data = g.read(max_bytes + 1)
        except (EOFError, OSError, zlib.error) as e:
            raise ValueError(
                f"{path} is not a complete gzip file ({type(e).__name__}: {e}): "
                "was it cut short or damaged?"
            ) from None
        if len(data) > max_bytes:
            raise ValueError(
                f"{path} unpacks to more than {max_bytes:,} bytes, more than a {what} may be: "
                "refused"
            )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path} is not UTF-8 text (byte {e.start}: {data[e.start : e.start + 1]!r}): "
            f"not a {what}"
        ) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path} is not JSON ({e.msg} at character {e.pos} of {len(text)}): "
            + (hint or "was the file cut short?")
        ) from None
    except RecursionError:
        raise ValueError(f"{path} nests JSON deeper than Python can read: not a {what}") from None


def _read_json(path: Path, max_bytes: int = MAX_RANK_FILE_BYTES) -> Any:
    return read_json_file(path, max_bytes, what="dplab trace file")


def _read_rank_doc(path: Path) -> dict:
    doc = _read_json(path)
    if not isinstance(doc, dict) or doc.get("format") != RUN_FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(
            f"{path} is not a dplab trace file (format {found!r}, expected {RUN_FORMAT!r})"
        )
    return doc


# What a malformed field raises inside from_dict: int("x"), float(None), a list where a dict
# was, a span list nested past the recursion limit.
_FIELD_ERRORS = (
    KeyError, ValueError, TypeError, IndexError, AttributeError, OverflowError, RecursionError
)  # fmt: skip


def _check_step(step: StepTrace) -> None:
    """The fields a timeline and the metrics divide and subtract by, checked to be sane:
    a NaN span time or ``world_size: 0`` would load and draw nothing, or divide by zero later."""
    if not 1 <= step.world_size <= MAX_WORLD_SIZE:
        raise ValueError(
            f"step {step.step}: world_size must be in 1..{MAX_WORLD_SIZE}, got {step.world_size}"
        )
    if not 0 <= step.rank < step.world_size:
        raise ValueError(f"step {step.step}: rank {step.rank} is not in 0..{step.world_size - 1}")
    if not math.isfinite(step.origin_ms):
        raise ValueError(f"step {step.step}: origin_ms must be finite, got {step.origin_ms}")
    for span in step.spans:
        if not (math.isfinite(span.start_ms) and math.isfinite(span.end_ms)):
            raise ValueError(
                f"step {step.step}: span {span.name!r} has a time that is not a finite number "
                f"(start_ms={span.start_ms}, end_ms={span.end_ms})"
            )
        if span.end_ms < span.start_ms:
            raise ValueError(
                f"step {step.step}: span {span.name!r} ends before it starts "
                f"(start_ms={span.start_ms}, end_ms={span.end_ms})"
            )


def _steps(doc: dict, path: Path) -> list[StepTrace]:
    raw = doc.get("steps")
    if not isinstance(raw, list) or not raw:
        found = f"{len(raw)} steps" if isinstance(raw, list) else f"{type(raw).__name__}"
        raise ValueError(f"{path}: 'steps' must be a non-empty list of steps, got {found}")
    try:
        steps = [StepTrace.from_dict(d) for d in raw]
        for step in steps:
            _check_step(step)
    except _FIELD_ERRORS as e:
        detail = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        raise ValueError(f"{path}: {detail}") from None
    return steps


def load_rank(path: str | os.PathLike) -> list[StepTrace]:
    """Read one rank's file back into StepTraces."""
    path = Path(path)
    return _steps(_read_rank_doc(path), path)


def load_run(out_dir: str | os.PathLike) -> list[list[StepTrace]]:
    """The ranks of the one run in ``out_dir``, ordered by rank; a clear error if it is not one.

    Only ``rank{N}.json`` names count as rank files (a ``rank0 (copy).json`` is ignored).
    """
    folder = Path(out_dir)
    if not folder.is_dir():
        raise FileNotFoundError(f"no run folder at {folder}")
    if (folder / MANIFEST).exists():
        return _load_with_manifest(folder)
    files = {
        int(m[1]): folder / m[0] for p in folder.iterdir() if (m := RANK_FILE.fullmatch(p.name))
    }
    if not files:
        raise FileNotFoundError(f"no rank*.json trace files in {folder}")
    docs = {r: _read_rank_doc(path) for r, path in sorted(files.items())}
    if any("run" in doc for doc in docs.values()):
        raise ValueError(
            f"{folder} has rank files of a dplab run but no {MANIFEST}: the run was not "
            "completely written (interrupted?); record it again"
        )
    return _load_legacy(folder, docs)


def _manifest(folder: Path) -> tuple[str, int]:
    """The run id and world size ``run.json`` names, every field checked: its rank files must
    be ``rank{r}.json`` in this folder, so a manifest can never point a reader elsewhere."""
    path = folder / MANIFEST
    manifest = _read_json(path, MAX_MANIFEST_BYTES)
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{path} is not a dplab run manifest")
    run_id, world_size, ranks = (manifest.get(k) for k in ("run_id", "world_size", "ranks"))
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"{path}: run_id must be a non-empty string, got {run_id!r}")
    if (
        isinstance(world_size, bool)
        or not isinstance(world_size, int)
        or not 1 <= world_size <= MAX_WORLD_SIZE
    ):
        raise ValueError(
            f"{path}: world_size must be an int in 1..{MAX_WORLD_SIZE}, got {world_size!r}"
        )
    expected = {str(r): f"rank{r}.json" for r in range(world_size)}
    if ranks != expected:
        shown = repr(ranks) if len(repr(ranks)) < 200 else repr(ranks)[:200] + "…"
        raise ValueError(
            f"{path}: ranks must map each rank r in 0..{world_size - 1} to 'rank{{r}}.json' in "
            f"this folder, got {shown}"
        )
    return run_id, world_size


def _load_with_manifest(folder: Path) -> list[list[StepTrace]]:
    run_id, world_size = _manifest(folder)
    out = []
    for rank in range(world_size):
        path = folder / f"rank{rank}.json"
        if not path.exists() and not path.is_symlink():
            raise FileNotFoundError(
                f"{folder}: rank{rank}.json is missing; {MANIFEST} says the run has "
                f"world size {world_size} (ranks 0..{world_size - 1})"
            )
        doc = _read_rank_doc(path)
        run = doc.get("run")
        found = run.get("id") if isinstance(run, dict) else None
        if found != run_id or doc.get("rank") != rank:
            raise ValueError(
                f"{path} is rank {doc.get('rank')} of run {found}, not rank {rank} of run "
                f"{run_id} named in {MANIFEST}: the folder mixes files of different runs"
            )
        steps = _steps(doc, path)
        _check_steps(steps, path, rank, world_size)
        out.append(steps)
    return out


def _check_steps(steps: list[StepTrace], path: Path, rank: int, world_size: int) -> None:
    bad = {(s.rank, s.world_size) for s in steps} - {(rank, world_size)}
    if bad:
        found = ", ".join(f"rank {r} of world size {w}" for r, w in sorted(bad))
        raise ValueError(
            f"{path} holds steps of {found}, expected rank {rank} of world size {world_size}: "
            "the folder mixes files of different runs"
        )


def _load_legacy(folder: Path, docs: dict[int, dict]) -> list[list[StepTrace]]:
    """A folder from before run ids: load it only if its files can be one run."""
    steps = {r: _steps(doc, folder / f"rank{r}.json") for r, doc in docs.items()}
    sizes = sorted({s.world_size for rank_steps in steps.values() for s in rank_steps})
    if len(sizes) != 1:
        raise ValueError(
            f"{folder} mixes runs of world sizes {sizes} (files {sorted(docs)}): "
            "was it written twice? record the run again into an empty folder"
        )
    world_size = sizes[0]
    missing = sorted(set(range(world_size)) - set(docs))
    extra = sorted(set(docs) - set(range(world_size)))
    if missing or extra:
        what = (
            f"rank files {', '.join(f'rank{r}.json' for r in missing)} are missing"
            if missing
            else ""
        )
        if extra:
            what += ("; " if what else "") + f"ranks {extra} are beyond world size {world_size}"
        raise ValueError(f"{folder}: the run has world size {world_size} but {what}")
    metas = {json.dumps(doc.get("meta"), sort_keys=True) for doc in docs.values()}
    if len(metas) != 1:
        raise ValueError(
            f"{folder}: the rank files carry different metadata (command, date): they come "
            "from different runs"
        )
    for rank, rank_steps in steps.items():
        _check_steps(rank_steps, folder / f"rank{rank}.json", rank, world_size)
    return [steps[r] for r in range(world_size)]
