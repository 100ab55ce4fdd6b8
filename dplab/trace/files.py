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
import json
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

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


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"no trace file at {path}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path} is not complete JSON ({e.msg} at character {e.pos} of {len(text)}): "
            "was the file cut short?"
        ) from None


def _read_rank_doc(path: Path) -> dict:
    doc = _read_json(path)
    if not isinstance(doc, dict) or doc.get("format") != RUN_FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(
            f"{path} is not a dplab trace file (format {found!r}, expected {RUN_FORMAT!r})"
        )
    return doc


def _steps(doc: dict, path: Path) -> list[StepTrace]:
    try:
        return [StepTrace.from_dict(d) for d in doc["steps"]]
    except (KeyError, ValueError, TypeError) as e:
        raise ValueError(f"{path}: {e}") from None


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


def _load_with_manifest(folder: Path) -> list[list[StepTrace]]:
    manifest = _read_json(folder / MANIFEST)
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{folder / MANIFEST} is not a dplab run manifest")
    run_id, world_size = manifest["run_id"], int(manifest["world_size"])
    out = []
    for rank in range(world_size):
        path = folder / manifest["ranks"][str(rank)]
        if not path.exists():
            raise FileNotFoundError(
                f"{folder}: rank{rank}.json is missing; {MANIFEST} says the run has "
                f"world size {world_size} (ranks 0..{world_size - 1})"
            )
        doc = _read_rank_doc(path)
        found = (doc.get("run") or {}).get("id")
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
