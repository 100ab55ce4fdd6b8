"""Imports in ``dplab/`` only point down the declared layers (docs/architecture.md).

Every import is read from the source with ``ast``: at module level and inside functions, plain
and relative, ``from package import module`` resolved to the module, and
``importlib.import_module("dplab....")`` with a literal name, and the modules a package's
``lazy_exports`` table names (imported on first use, still imports). A module may import from
its own layer or a lower one; an import from a higher layer is a failure naming both files.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dplab"

# Lowest first. A module belongs to the layer of the longest prefix that names it.
LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "dplab._units",
        "dplab._checks",
        "dplab.env",
        "dplab._nested",
        "dplab._lazy",
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
    ("dplab.exercises",),
    ("dplab.viz",),
    ("dplab.widgets", "dplab.cli", "dplab.__main__"),
)


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    if best is None:
        raise LookupError(module)
    return best


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(name: str) -> bool:
    """Whether ``name`` is a module or package of this tree (not a name inside a module)."""
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, dplab module) for every import in the file, wherever it is."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
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
                found.append((node.lineno, full if is_module(full) else source))
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


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_layer():
    unplaced = []
    for path in SOURCES:
        try:
            layer_of(module_name(path))
        except LookupError:
            unplaced.append(str(path.relative_to(ROOT)))
    assert not unplaced, f"modules in no layer (add them to LAYERS): {unplaced}"


def test_imports_only_point_down():
    upward = []
    for path in SOURCES:
        me = module_name(path)
        mine = layer_of(me)
        for line, target in imports_of(path):
            theirs = layer_of(target)
            if theirs > mine:
                upward.append(
                    f"{path.relative_to(ROOT)}:{line} (layer {mine + 1}) imports {target} "
                    f"(layer {theirs + 1})"
                )
    assert not upward, "imports that point up:\n" + "\n".join(upward)


def _graph() -> dict[str, set[str]]:
    """Subpackage → subpackages it imports (``dplab.x.y`` counted as ``dplab.x``)."""

    def unit(module: str) -> str:
        return ".".join(module.split(".")[:2])

    graph: dict[str, set[str]] = {}
    for path in SOURCES:
        me = unit(module_name(path))
        for _, target in imports_of(path):
            if unit(target) != me and target != "dplab":
                graph.setdefault(me, set()).add(unit(target))
    return graph


def test_no_import_circles_between_subpackages():
    graph = _graph()
    seen: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        seen[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if seen.get(nxt) == 1:
                return [*path, node, nxt]
            if nxt not in seen and (circle := visit(nxt, [*path, node])):
                return circle
        seen[node] = 2
        return None

    for start in sorted(graph):
        if start not in seen and (circle := visit(start, [])):
            pytest.fail("import circle: " + " -> ".join(circle))


# The checker itself: an upward import, inside a function and relative, must be seen.
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
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        found = [m for _, m in imports_of(fake / "m.py")]
    finally:
        ROOT = saved
    assert sorted(found) == sorted(
        ["dplab.viz.timeline", "dplab.widgets", "dplab.cli", "dplab.sim.engine"]
    )
    assert sorted(layer_of(m) for m in found) == [3, 5, 6, 6] and layer_of("dplab.trace.m") == 1
