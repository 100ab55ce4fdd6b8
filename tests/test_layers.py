"""The house rules of ``dplab/`` (docs/architecture.md), read from the source with ``ast``:

- imports only point down the declared layers (a module may import from its own layer or a lower
  one; an import from a higher layer fails, naming both files);
- no import circle, neither between rooms (the prefixes of LAYERS: a subpackage, a top-level
  module) nor between two modules of one room;
- no module over 600 lines.

Every import counts: at module level, inside functions and under ``if TYPE_CHECKING:``, plain
and relative, ``from package import module`` resolved to the module, ``importlib.import_module(
"dplab....")`` with a literal name, and the modules a package's ``lazy_exports`` table names
(imported on first use, still imports). Imports inside functions count for circles too: a
function-level import only postpones the circle to the first call, and the two modules still need
each other, so neither can be read, tested or moved alone (the two circles issue 43 found, both
gone now, were of these kinds: ``ddp/ddp.py`` ↔ ``ddp/variants.py`` through ddp's module
``__getattr__``, ``sim/fabric.py`` ↔ ``sim/fit.py`` under ``TYPE_CHECKING``). An import names
one module: ``import dplab.a.b`` is an edge to ``dplab.a.b``, not to the packages Python runs on
the way.

Each rule is a function of the tree's root, so the last tests run it on a copy of the package
with one violation planted and see it fail naming the planted files (an assert that cannot fail
is a defect).
"""

from __future__ import annotations

import ast
import functools
import shutil
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dplab"
MAX_LINES = 600

# Lowest first. A module belongs to the layer of the longest prefix that names it.
LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "dplab._units",
        "dplab._checks",
        "dplab.env",
        "dplab._nested",
        "dplab._lazy",
        "dplab._moved",
        "dplab.model_config",
    ),
    (
        "dplab.launch",
        "dplab._worker",
        "dplab.nodes",
        "dplab.models",
        "dplab.trace",
        "dplab.collectives",
    ),
    # the package root re-exports launch, DDP and the trace: it sits with what it re-exports
    ("dplab.ddp", "dplab"),
    ("dplab.sim", "dplab.memory", "dplab.mechanics", "dplab.sharding", "dplab.failures"),
    # The job doctor reads a user's trace and asks the simulator what-if: above sim and trace,
    # which never import it; the CLI sits above it. Its old addresses in sim/ are aliases for one
    # release (dplab._moved): rooms of their own in the doctor's layer, imported by nothing.
    ("dplab.doctor", "dplab.sim.doctor", "dplab.sim.from_trace", "dplab.sim.straggler"),
    ("dplab.exercises",),
    ("dplab.viz",),
    ("dplab.widgets", "dplab.cli", "dplab.__main__"),
)


def names(prefix: str, module: str) -> bool:
    """Whether ``prefix`` of LAYERS names ``module``. ``dplab`` names the package root alone,
    so a new room or top-level module is in no layer until it is added (not in the root's)."""
    return module == prefix or (prefix != "dplab" and module.startswith(prefix + "."))


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if names(prefix, module) and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    if best is None:
        raise LookupError(module)
    return best


def sources(root: Path = ROOT) -> list[Path]:
    return sorted((root / "dplab").rglob("*.py"))


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def module_path(name: str, root: Path = ROOT) -> Path | None:
    """The file of module or package ``name`` in the tree, or None (a name inside a module)."""
    path = root.joinpath(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def is_module(name: str, root: Path = ROOT) -> bool:
    """Whether ``name`` is a module or package of this tree (not a name inside a module)."""
    return module_path(name, root) is not None


@functools.cache
def _parse(source: str) -> ast.Module:
    """The tree of a source text (the planted copies share most files' text with the tree)."""
    return ast.parse(source)


def imports_of(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, dplab module) for every import in the file, wherever it is."""
    me = module_name(path, root)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(_parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                full = f"{source}.{alias.name}"
                found.append((node.lineno, full if is_module(full, root) else source))
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value))
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "lazy_exports"
            and len(node.args) == 2
            and isinstance(node.args[1], ast.Dict)
        ):
            keys = node.args[1].keys
            found += [(node.lineno, k.value) for k in keys if isinstance(k, ast.Constant)]
    return [(line, m) for line, m in found if m == "dplab" or m.startswith("dplab.")]


# -- the rules, each a function of the tree's root: what breaks it, one line each -------------


def unplaced_modules(root: Path = ROOT) -> list[str]:
    """Modules that no prefix of LAYERS names."""
    unplaced = []
    for path in sources(root):
        try:
            layer_of(module_name(path, root))
        except LookupError:
            unplaced.append(str(path.relative_to(root)))
    return unplaced


def upward_imports(root: Path = ROOT) -> list[str]:
    """Every import of a module from a higher layer than the importer's, with file and line."""
    upward = []
    for path in sources(root):
        mine = layer_of(module_name(path, root))
        for line, target in imports_of(path, root):
            theirs = layer_of(target)
            if theirs > mine:
                upward.append(
                    f"{path.relative_to(root)}:{line} (layer {mine + 1}) imports {target} "
                    f"(layer {theirs + 1})"
                )
    return upward


# An edge of an import graph: (importer, imported) -> (file, line) of the first such import.
Edges = dict[tuple[str, str], tuple[str, int]]


def module_edges(root: Path = ROOT) -> Edges:
    """Module → module it imports, for the modules of this tree (a package is its __init__)."""
    edges: Edges = {}
    for path in sources(root):
        me = module_name(path, root)
        for line, target in imports_of(path, root):
            if target != me and is_module(target, root):
                edges.setdefault((me, target), (str(path.relative_to(root)), line))
    return edges


def room_of(module: str) -> str:
    """The room of a module: the longest prefix of LAYERS that names it (``dplab.sim``, or
    ``dplab.sim.doctor`` for the doctor's alias left at its old address)."""
    prefixes = [p for layer in LAYERS for p in layer]
    return max((p for p in prefixes if names(p, module)), key=len, default=module)


def room_edges(root: Path = ROOT) -> Edges:
    """Room → room it imports."""
    edges: Edges = {}
    for (me, target), where in module_edges(root).items():
        a, b = room_of(me), room_of(target)
        if a != b:
            edges.setdefault((a, b), where)
    return edges


def circles(edges: Edges) -> list[list[str]]:
    """One circle per strongly connected group of the graph, shortest through its first node."""
    graph: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        graph.setdefault(a, []).append(b)
        graph.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while (w := stack.pop()) != v:
                group.add(w)
            if group:
                groups.append(group | {v})

    for v in graph:
        if v not in index:
            connect(v)
    found = []
    for group in groups:
        start = min(group)
        came_from: dict[str, str] = {}  # breadth first from start, inside the group, back to it
        frontier = [start]
        while start not in came_from and frontier:
            reached = []
            for v in frontier:
                for w in graph[v]:
                    if w in group and w not in came_from:
                        came_from[w] = v
                        reached.append(w)
            frontier = reached
        path = [start]
        while (prev := came_from[path[0]]) != start:
            path.insert(0, prev)
        found.append([start, *path])
    return sorted(found)


def describe(circle: list[str], edges: Edges) -> str:
    """``a -> b -> a``, each step with the file and line that makes it."""
    steps = []
    for a, b in pairwise(circle):
        file, line = edges[(a, b)]
        steps.append(f"{file}:{line} imports {b}")
    return "import circle: " + " -> ".join(steps)


def room_circles(root: Path = ROOT) -> list[str]:
    edges = room_edges(root)
    return [describe(c, edges) for c in circles(edges)]


def module_circles(root: Path = ROOT) -> list[str]:
    edges = module_edges(root)
    return [describe(c, edges) for c in circles(edges)]


def long_modules(root: Path = ROOT) -> list[str]:
    """Modules over MAX_LINES lines (counted as ``wc -l`` does, for a file ending in a newline)."""
    long = []
    for path in sources(root):
        n = len(path.read_text().splitlines())
        if n > MAX_LINES:
            long.append(f"{path.relative_to(root)}: {n} lines")
    return long


# -- the rules on this tree --------------------------------------------------------------------


def test_every_module_has_a_layer():
    unplaced = unplaced_modules()
    assert not unplaced, "modules in no layer (add them to LAYERS):\n" + "\n".join(unplaced)


def test_imports_only_point_down():
    upward = upward_imports()
    assert not upward, "imports that point up:\n" + "\n".join(upward)


def test_no_import_circles_between_rooms():
    found = room_circles()
    assert not found, "circles between rooms:\n" + "\n".join(found)


def test_no_import_circles_between_modules():
    found = module_circles()
    assert not found, "circles between modules:\n" + "\n".join(found)


def test_no_module_is_over_600_lines():
    long = long_modules()
    assert not long, f"modules over {MAX_LINES} lines (split them by idea):\n" + "\n".join(long)


# -- the rules catch what they claim to (a violation planted in a copy) ------------------------


def test_the_walker_sees_imports_inside_functions_and_relative(tmp_path):
    fake = tmp_path / "dplab" / "trace"
    fake.mkdir(parents=True)
    (tmp_path / "dplab" / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (tmp_path / "dplab" / "viz").mkdir()
    (tmp_path / "dplab" / "viz" / "__init__.py").write_text("")
    (tmp_path / "dplab" / "viz" / "timeline.py").write_text("")
    (fake / "m.py").write_text(
        "def f():\n    from ..viz import timeline\n    import dplab.widgets\n"
        "    importlib.import_module('dplab.cli')\n"
        "__getattr__, __dir__, __all__ = lazy_exports(globals(), {'dplab.sim.engine': ['x']})\n"
    )
    found = [m for _, m in imports_of(fake / "m.py", tmp_path)]
    assert sorted(found) == sorted(
        ["dplab.viz.timeline", "dplab.widgets", "dplab.cli", "dplab.sim.engine"]
    )
    expected = [layer_of(p) for p in ("dplab.sim", "dplab.viz", "dplab.cli", "dplab.widgets")]
    assert sorted(layer_of(m) for m in found) == sorted(expected)
    assert layer_of("dplab.trace.m") == 1


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """A copy of the package's sources, to plant a violation in."""
    shutil.copytree(PACKAGE, tmp_path / "dplab", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def _planted(rule: Callable[[Path], list[str]], copy: Path, plant: Callable[[], None]) -> list[str]:
    """What ``rule`` finds in the copy after ``plant()`` that it did not find before.

    Compared with the unplanted copy, so the test says the same whether or not the tree itself
    keeps the rule today.
    """
    before = rule(copy)
    plant()
    return [line for line in rule(copy) if line not in before]


def _append(copy: Path, file: str, text: str) -> None:
    path = copy / file
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.parent / "__init__.py").touch()
    path.write_text((path.read_text() if path.exists() else "") + text)


@pytest.mark.parametrize(
    "planted",
    [
        "from dplab.trace.step import Span  # planted\n",  # module level
        "\n\ndef _planted():\n    from dplab.trace import step\n",  # inside a function
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .step import Span\n",
    ],
    ids=["module-level", "inside-a-function", "type-checking"],
)
def test_a_circle_inside_a_room_is_named(copy, planted):
    # dplab/trace/step.py imports bucket.py; bucket.py importing step.py closes a circle
    new = _planted(module_circles, copy, lambda: _append(copy, "dplab/trace/bucket.py", planted))
    assert len(new) == 1, new
    assert new[0].startswith("import circle: dplab/trace/bucket.py:"), new
    assert " -> dplab/trace/step.py:" in new[0], new
    assert new[0].count(" imports ") == 2, new  # bucket -> step -> bucket


def test_a_circle_through_three_new_modules_is_named_in_order(copy):
    def plant() -> None:
        for a, b in (("a", "b"), ("b", "c"), ("c", "a")):
            _append(copy, f"dplab/mechanics/_planted_{a}.py", f"from . import _planted_{b}\n")

    new = _planted(module_circles, copy, plant)
    assert new == [
        "import circle: dplab/mechanics/_planted_a.py:1 imports dplab.mechanics._planted_b -> "
        "dplab/mechanics/_planted_b.py:1 imports dplab.mechanics._planted_c -> "
        "dplab/mechanics/_planted_c.py:1 imports dplab.mechanics._planted_a"
    ]


def test_a_circle_between_rooms_is_named(copy):
    def plant() -> None:  # sim and memory share layer 4: only the circle rule stops this
        _append(copy, "dplab/sim/engine.py", "from dplab.memory import state  # planted\n")
        _append(copy, "dplab/memory/state.py", "\n\ndef _f():\n    from dplab.sim import link\n")

    new = _planted(room_circles, copy, plant)
    assert len(new) == 1 and "dplab/memory/state.py:" in new[0], new
    assert "dplab/sim/engine.py:" in new[0] and " imports dplab.memory" in new[0], new


def test_an_import_pointing_up_is_named(copy):
    new = _planted(
        upward_imports,
        copy,
        lambda: _append(copy, "dplab/trace/step.py", "from dplab.viz import timeline_figure\n"),
    )
    assert len(new) == 1 and new[0].startswith("dplab/trace/step.py:"), new
    assert "(layer 2) imports dplab.viz (layer 7)" in new[0], new


def test_the_doctor_sits_above_sim_and_trace_and_below_the_cli(copy):
    def doctor_reads_sim_and_trace_and_cli_reads_doctor() -> None:
        _append(copy, "dplab/doctor/_planted.py", "import dplab.sim.engine\n")
        _append(copy, "dplab/doctor/_planted.py", "from dplab.trace import step\n")
        _append(copy, "dplab/cli/_planted.py", "from dplab.doctor import _planted\n")

    def sim_reads_doctor() -> None:
        _append(copy, "dplab/sim/engine.py", "\n\ndef f():\n    import dplab.doctor\n")

    assert _planted(upward_imports, copy, doctor_reads_sim_and_trace_and_cli_reads_doctor) == []
    new = _planted(upward_imports, copy, sim_reads_doctor)
    assert len(new) == 1 and new[0].startswith("dplab/sim/engine.py:"), new
    assert "(layer 4) imports dplab.doctor (layer 5)" in new[0], new


def test_a_module_of_601_lines_is_named_and_600_pass(copy):
    def pad_to(n: int) -> None:
        path = copy / "dplab" / "_units.py"
        lines = path.read_text().splitlines()
        path.write_text("\n".join(lines + ["# planted"] * (n - len(lines))) + "\n")

    assert _planted(long_modules, copy, lambda: pad_to(MAX_LINES)) == []
    new = _planted(long_modules, copy, lambda: pad_to(MAX_LINES + 1))
    assert new == ["dplab/_units.py: 601 lines"]


def test_a_module_in_no_layer_is_named(copy):
    new = _planted(
        unplaced_modules,
        copy,
        lambda: _append(copy, "dplab/nowhere/m.py", "x = 1\n"),
    )
    assert new == ["dplab/nowhere/__init__.py", "dplab/nowhere/m.py"]
