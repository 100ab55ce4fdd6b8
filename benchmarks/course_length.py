"""How long is the course? Words of prose and code cells per notebook, against the course's budget.

A learner finishes a course they can read; the distilled course keeps the whole path under
12,000 words of prose and 150 code cells, no notebook over 20 code cells. Prose is what the
markdown cells say in words: display math (``$$...$$``), inline math (``$...$``), inline code
(`` `...` ``), fenced code, HTML tags and link targets are left out, since they are not sentences
a learner reads. Words in code comments are counted apart (they are read too, but are not prose).

    python benchmarks/course_length.py            # the table
    python benchmarks/course_length.py --check    # exit 1 when a budget is exceeded
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
MAX_WORDS = 12_000
MAX_CODE_CELLS = 150
MAX_CELLS_PER_NOTEBOOK = 20

_STRIP = (
    re.compile(r"```.*?```", re.S),
    re.compile(r"\$\$.*?\$\$", re.S),
    re.compile(r"\$[^$\n]+\$"),
    re.compile(r"`[^`\n]+`"),
    re.compile(r"<[^>\n]+>"),
    re.compile(r"\]\([^)\s]+\)"),
)


def prose_words(markdown: str) -> int:
    """Words a learner reads in a markdown cell (math, code, tags and link targets left out)."""
    for pattern in _STRIP:
        markdown = pattern.sub(" ", markdown)
    return sum(1 for w in markdown.split() if re.search(r"[A-Za-z0-9]", w))


def comment_words(code: str) -> int:
    """Words in a code cell's ``#`` comments."""
    return sum(len(line.split("#", 1)[1].split()) for line in code.splitlines() if "#" in line)


def measure(path: Path) -> dict[str, int]:
    """Code cells, prose words and comment words of one notebook."""
    cells = json.loads(path.read_text())["cells"]
    markdown = ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    return {
        "code_cells": len(code),
        "words": sum(prose_words(t) for t in markdown),
        "comment_words": sum(comment_words(t) for t in code),
    }


def table(rows: dict[str, dict[str, int]]) -> str:
    """The Markdown table docs/benchmarks.md keeps, with the totals and the budget."""
    lines = ["| notebook | code cells | words of prose | words in comments |", "|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['code_cells']} | {r['words']:,} | {r['comment_words']:,} |")
    cells = sum(r["code_cells"] for r in rows.values())
    words = sum(r["words"] for r in rows.values())
    comments = sum(r["comment_words"] for r in rows.values())
    lines.append(f"| **course** | **{cells}** | **{words:,}** | {comments:,} |")
    lines.append(
        f"| budget | {MAX_CODE_CELLS} (≤ {MAX_CELLS_PER_NOTEBOOK} each) | {MAX_WORDS:,} | — |"
    )
    return "\n".join(lines)


def over_budget(rows: dict[str, dict[str, int]]) -> list[str]:
    """Each budget the course exceeds, in words."""
    problems = [
        f"{name}: {r['code_cells']} code cells (at most {MAX_CELLS_PER_NOTEBOOK})"
        for name, r in rows.items()
        if r["code_cells"] > MAX_CELLS_PER_NOTEBOOK
    ]
    cells = sum(r["code_cells"] for r in rows.values())
    words = sum(r["words"] for r in rows.values())
    if cells > MAX_CODE_CELLS:
        problems.append(f"the course has {cells} code cells (at most {MAX_CODE_CELLS})")
    if words > MAX_WORDS:
        problems.append(f"the course has {words:,} words of prose (at most {MAX_WORDS:,})")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a budget is exceeded")
    args = parser.parse_args()
    rows = {p.name: measure(p) for p in sorted(NOTEBOOKS.glob("*.ipynb"))}
    print(table(rows))
    problems = over_budget(rows)
    for p in problems:
        print("over budget:", p)
    return 1 if args.check and problems else 0


if __name__ == "__main__":
    sys.exit(main())
