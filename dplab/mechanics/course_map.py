"""The course's map in 00: the lessons its links name, the lessons on disk, their recorded times.

00 (start here) links every lesson of the path; a lesson added, renamed or removed without the
map following is a learner sent to a missing file. :func:`map_links` reads the links from the
notebook's own markdown and :func:`lessons_in` lists the folder, so the notebook can assert they
agree. :func:`recorded_times` reads how long each lesson took under nbval, as
``benchmarks/notebook_flakiness.py --times`` records it in ``assets/notebook_times.json``; a
missing file, key or entry reads as "not measured yet", never as an error.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[2] / "assets"
TIMES_JSON = ASSETS / "notebook_times.json"
START = "00_start_here.ipynb"
_LESSON = re.compile(r"\d\d[a-z]?_[\w.-]+\.ipynb")
_LINK = re.compile(r"\]\((\d\d[a-z]?_[\w.-]+\.ipynb)\)")


def markdown_of(notebook: str | Path) -> str:
    """The text of a notebook's markdown cells, in order."""
    cells = json.loads(Path(notebook).read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def map_links(notebook: str | Path) -> list[str]:
    """The lesson files a notebook's markdown links to, in the order they first appear."""
    return list(dict.fromkeys(_LINK.findall(markdown_of(notebook))))


def last_link(notebook: str | Path) -> str | None:
    """The target of the notebook's last markdown link: where a reader who follows it goes."""
    targets = re.findall(r"\]\(([^)\s]+)\)", markdown_of(notebook))
    return targets[-1] if targets else None


def lessons_in(folder: str | Path = ".") -> list[str]:
    """The lesson notebooks in ``folder`` (``NN_name`` or ``NNx_name``), sorted, 00 left out."""
    names = (p.name for p in Path(folder).glob("[0-9][0-9]*_*.ipynb"))
    return sorted(n for n in names if _LESSON.fullmatch(n) and n != START)


@dataclass(frozen=True)
class LessonTimes:
    """Seconds per lesson under nbval, and how they were recorded (date, cores, command)."""

    seconds: dict[str, float] = field(default_factory=dict)
    recorded: dict[str, object] = field(default_factory=dict)

    def describe(self, name: str) -> str:
        took = self.seconds.get(name)
        return "not measured yet" if took is None else f"{took:4.0f} s"


def recorded_times(path: str | Path = TIMES_JSON) -> LessonTimes:
    """The recorded lesson times, or none: a missing or partial file is not an error."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError):
        return LessonTimes()
    if not isinstance(data, dict):
        return LessonTimes()
    seconds = data.get("seconds") if isinstance(data.get("seconds"), dict) else {}
    recorded = data.get("recorded") if isinstance(data.get("recorded"), dict) else {}
    numbers = {k: v for k, v in seconds.items() if not isinstance(v, bool)}
    return LessonTimes(
        {k: float(v) for k, v in numbers.items() if isinstance(v, int | float)}, recorded
    )
