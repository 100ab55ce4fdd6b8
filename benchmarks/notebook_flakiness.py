"""How often does each lesson go red for a reason a learner cannot see? Red runs per cell.

Each round runs every notebook once under nbval (``pytest --nbval-lax``), in an order that
rotates from round to round, so a slow moment of the machine does not always land on the same
lesson. ``--load cpu`` keeps one CPU-bound process busy beside the runs (a browser tab, a
compile: what a learner's laptop is doing anyway). For every notebook it reports the red runs,
the cells that failed and how often, and the median time; ``--times`` also writes the medians to
``assets/notebook_times.json``, which ``00_start_here`` prints as the time each lesson takes.

    flock /tmp/dplab-cpu.lock python benchmarks/notebook_flakiness.py --runs 20
    flock /tmp/dplab-cpu.lock python benchmarks/notebook_flakiness.py --runs 10 --load cpu
    python benchmarks/notebook_flakiness.py --runs 1 --times    # refresh the recorded times

Twenty rounds are hours of a 2-core machine. ``--append FILE`` adds this call's runs to the
tallies saved in FILE (created if missing; one load per file), so rounds can be spread over
sessions, one notebook at a time, leaving the lock free between runs for other work; ``--report
FILE`` prints the table of a saved file without running anything. A saved tally belongs to one
version of its notebook (the file's SHA-256): when the notebook has changed since, its old runs
are dropped, and said so. Each tally also lists the commits its runs were made on.

Run it under the CPU lock on a machine with nothing else running: the point is the lessons'
own margins, measured on the same 2 cores CI has.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
TIMES_JSON = REPO / "assets" / "notebook_times.json"
RUN_TIMEOUT_S = 600


@dataclass
class Tally:
    """One notebook's runs: how many, how many red, which cells failed, how long each took."""

    runs: int = 0
    red: int = 0
    failed_cells: Counter = field(default_factory=Counter)
    seconds: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    sha: str = ""  # of the notebook the runs ran
    commits: list[str] = field(default_factory=list)

    def add(self, other: Tally) -> None:
        self.commits += [c for c in other.commits if c not in self.commits]
        self.runs += other.runs
        self.red += other.red
        self.failed_cells.update(other.failed_cells)
        self.seconds += other.seconds
        self.errors += other.errors

    def to_dict(self) -> dict:
        return {"runs": self.runs, "red": self.red, "failed_cells": dict(self.failed_cells),
                "seconds": self.seconds, "errors": self.errors[:3], "sha": self.sha,
                "commits": self.commits}  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict) -> Tally:
        return cls(d["runs"], d["red"], Counter(d["failed_cells"]), list(d["seconds"]),
                   list(d["errors"]), d["sha"], list(d["commits"]))  # fmt: skip


def notebook_sha(notebook: Path) -> str:
    return hashlib.sha256(notebook.read_bytes()).hexdigest()[:16]


def head_commit() -> str:
    """The commit the runs are made on, ``-dirty`` when the working tree differs from it."""
    done = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO,
                          capture_output=True, text=True)  # fmt: skip
    return done.stdout.strip() or "unknown"


def load_saved(path: Path, load: str) -> dict[str, Tally]:
    """The tallies saved in ``path`` by ``--append`` (none when it does not exist yet)."""
    if not path.exists():
        return {}
    saved = json.loads(path.read_text())
    if saved.get("load") != load:
        raise SystemExit(f"{path} holds runs with load {saved.get('load')!r}, not {load!r}")
    return {name: Tally.from_dict(d) for name, d in saved["notebooks"].items()}


def run_once(notebook: Path) -> tuple[bool, list[str], float, str]:
    """One nbval run: (passed, failed cell names, seconds, and when red each failing cell's
    failing line and error, or the tail of the output where no cell was named)."""
    with tempfile.TemporaryDirectory(prefix="dplab-flaky-") as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax",
               f"--junitxml={junit}", str(notebook)]  # fmt: skip
        t0 = time.perf_counter()
        try:
            done = subprocess.run(
                cmd, cwd=REPO, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            return False, ["(timed out)"], time.perf_counter() - t0, "timed out"
        seconds = time.perf_counter() - t0
        failed, texts = [], []
        if junit.exists():
            for case in ET.parse(junit).getroot().iter("testcase"):
                problems = [p for p in (case.find("failure"), case.find("error")) if p is not None]
                if problems:
                    failed.append(case.get("name", "?"))
                    line = failing_line(problems[0].text or "")[-ERROR_CHARS:]
                    texts.append(f"--- {failed[-1]}:\n{line}")
        ok = done.returncode == 0
        if ok:
            return ok, failed, seconds, ""
        return ok, failed, seconds, "\n".join(texts) or (done.stdout + done.stderr)[-1500:]


# colour codes, raw or as pytest's junit writer escapes the ESC character
ANSI = re.compile(r"(?:\x1b|#x1B)\[[0-9;]*m")
ARROW = re.compile(r"\s*-*> \d")  # IPython's mark of the failing line: "----> 3", "--> 120"
ERROR_CHARS = 1500  # per failing cell, as much as the whole tail was before


def failing_line(text: str, context: int = 6) -> str:
    """The lines around IPython's arrow (the cell's failing line) and the error's last line,
    without colour codes: enough to tell which assert of a cell went red."""
    lines = ANSI.sub("", text).splitlines()
    marks = [i for i, line in enumerate(lines) if ARROW.match(line)]
    if not marks:
        return "\n".join(lines[-context:])
    i = marks[0]
    error = next((line for line in reversed(lines) if line.strip()), "")
    return "\n".join([*lines[max(0, i - context) : i + 2], "...", error])


def cpu_hog() -> subprocess.Popen:
    """One CPU-bound process, the kind of load a learner's machine always has."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def run_rounds(notebooks: list[Path], runs: int, load: str) -> dict[str, Tally]:
    commit = head_commit()
    tallies = {nb.name: Tally(sha=notebook_sha(nb), commits=[commit]) for nb in notebooks}
    hog = cpu_hog() if load == "cpu" else None
    try:
        for k in range(runs):
            order = notebooks[k % len(notebooks) :] + notebooks[: k % len(notebooks)]
            for nb in order:
                ok, failed, seconds, tail = run_once(nb)
                t = tallies[nb.name]
                t.runs += 1
                t.seconds.append(seconds)
                if not ok:
                    t.red += 1
                    t.failed_cells.update(failed or ["(no cell named)"])
                    t.errors.append(tail)
                print(f"round {k + 1}/{runs} {nb.name}: {'green' if ok else 'RED ' + str(failed)}"
                      f" in {seconds:.0f} s", flush=True)  # fmt: skip
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    return tallies


def report(tallies: dict[str, Tally], load: str) -> str:
    lines = [
        f"| notebook | runs | red | failing cells (count) | median s | max s |  load: {load}",
        "|---|--:|--:|---|--:|--:|",
    ]
    for name, t in tallies.items():
        cells = ", ".join(f"{c} ({n})" for c, n in t.failed_cells.most_common()) or "-"
        lines.append(f"| {name} | {t.runs} | {t.red} | {cells} | "
                     f"{statistics.median(t.seconds):.0f} | {max(t.seconds):.0f} |")  # fmt: skip
    return "\n".join(lines)


def write_times(tallies: dict[str, Tally], command: str) -> None:
    """The median nbval time of each lesson, with where and when it was measured."""
    record = {
        "recorded": {
            "date": datetime.date.today().isoformat(),
            "cores": os.cpu_count(),
            "machine": platform.processor() or platform.machine(),
            "command": command,
        },
        "seconds": {name: round(statistics.median(t.seconds), 1) for name, t in tallies.items()},
    }
    TIMES_JSON.write_text(json.dumps(record, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="rounds over every notebook")
    ap.add_argument("--load", choices=("none", "cpu"), default="none")
    ap.add_argument("--only", nargs="*", help="notebook names (default: every lesson)")
    ap.add_argument("--times", action="store_true", help=f"write {TIMES_JSON.name}")
    ap.add_argument("--json", type=Path, help="write the tallies here")
    ap.add_argument("--append", type=Path, help="add this call's runs to the tallies saved here")
    ap.add_argument("--report", type=Path, help="print the table of a saved file, run nothing")
    args = ap.parse_args(argv)
    if args.report:
        saved = json.loads(args.report.read_text())
        tallies = load_saved(args.report, saved["load"])
        print(report(tallies, saved["load"]))
        for name, t in tallies.items():
            if not (NOTEBOOKS / name).exists() or notebook_sha(NOTEBOOKS / name) != t.sha:
                print(f"{name}: its runs are of an older version of the notebook (stale)")
        return 0
    if args.runs < 1:
        ap.error(f"--runs must be at least 1, got {args.runs}")
    notebooks = sorted(NOTEBOOKS.glob("[0-9][0-9]*.ipynb"))
    if args.only:
        wanted = {n.removesuffix(".ipynb") for n in args.only}
        notebooks = [nb for nb in notebooks if nb.stem in wanted]
        if not notebooks:
            ap.error(f"no notebook named {sorted(wanted)}")
    total = load_saved(args.append, args.load) if args.append else {}  # before any run
    tallies = run_rounds(notebooks, args.runs, args.load)
    if args.append:
        for name, t in tallies.items():
            old = total.get(name)
            if old is not None and old.sha == t.sha:
                old.add(t)
                continue
            if old is not None:
                print(f"{name} changed since its {old.runs} saved runs: they are dropped")
            total[name] = t
        args.append.write_text(json.dumps({"load": args.load, "notebooks": {
            name: t.to_dict() for name, t in sorted(total.items())}}, indent=1))  # fmt: skip
        tallies = total
    print(report(tallies, args.load))
    for name, t in tallies.items():
        for tail in t.errors[:1]:
            print(f"\n--- {name}, first red run:\n{tail}")
    if args.json:
        args.json.write_text(json.dumps({n: t.to_dict() for n, t in tallies.items()}, indent=1))
    if args.times:
        write_times(
            tallies, "python benchmarks/notebook_flakiness.py " + " ".join(argv or sys.argv[1:])
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
