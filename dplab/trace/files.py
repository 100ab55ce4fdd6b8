"""Trace files: one JSON per rank, one merged Chrome trace-event file that Perfetto opens.

Files are written atomically (a temporary file in the same folder, then a rename), so an
interrupted run never leaves a half-written trace where a complete one used to be. Reading a
truncated or foreign file is a clear error that names the file.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from dplab.trace.step import StepTrace, chrome_trace

RUN_FORMAT = "dplab.run/1"


def write_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def save_rank(steps: list[StepTrace], path: str | os.PathLike, meta: dict | None = None) -> Path:
    """One rank's steps as ``{"format": "dplab.run/1", "rank", "meta", "steps": [...]}``."""
    if not steps:
        raise ValueError("no steps to save")
    doc = {
        "format": RUN_FORMAT,
        "rank": steps[0].rank,
        "meta": dict(meta or {}),
        "steps": [s.to_dict() for s in steps],
    }
    return write_atomic(path, json.dumps(doc))


def save_run(
    steps_by_rank: list[list[StepTrace]], out_dir: str | os.PathLike, meta: dict | None = None
) -> dict[str, Path]:
    """``rank{r}.json`` for every rank and ``trace.json`` (all ranks, Chrome trace events)."""
    out = Path(out_dir)
    paths = {
        f"rank{steps[0].rank}": save_rank(steps, out / f"rank{steps[0].rank}.json", meta)
        for steps in steps_by_rank
    }
    merged = chrome_trace([s for steps in steps_by_rank for s in steps])
    merged["otherData"].update(meta or {})
    paths["chrome"] = write_atomic(out / "trace.json", json.dumps(merged))
    return paths


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


def load_rank(path: str | os.PathLike) -> list[StepTrace]:
    """Read one rank's file back into StepTraces."""
    path = Path(path)
    doc = _read_json(path)
    if not isinstance(doc, dict) or doc.get("format") != RUN_FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(
            f"{path} is not a dplab trace file (format {found!r}, expected {RUN_FORMAT!r})"
        )
    try:
        return [StepTrace.from_dict(d) for d in doc["steps"]]
    except (KeyError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None


def load_run(out_dir: str | os.PathLike) -> list[list[StepTrace]]:
    """Every ``rank*.json`` of a run folder, ordered by rank."""
    folder = Path(out_dir)
    files = sorted(
        folder.glob("rank*.json"), key=lambda p: int(p.stem[4:]) if p.stem[4:].isdigit() else -1
    )
    if not files:
        raise FileNotFoundError(f"no rank*.json trace files in {folder}")
    return [load_rank(f) for f in files]
