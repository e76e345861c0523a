"""The package's layers, read from the source: every import, at the top of a module or inside a
function, goes to the same floor or a lower one, and no module imports itself back through others.

The floor order is the one docs/ARCHITECTURE.md draws; a module listed there under a floor is that
floor's, so a new package has to be placed on purpose.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "kvwise"

# lowest first; a unit is a subpackage or a top-level module of kvwise
FLOORS = (
    ("_version", "util", "presets"),  # no kvwise imports of their own (util imports util only)
    ("core",),  # bookkeeping: block pool, block keys, radix tree
    ("kv",),
    ("policies",),
    ("tiers",),
    ("hf",),
    ("models",),
    ("engine",),
    ("adaptive",),
    ("server",),
    ("cluster",),
    ("bench",),
    ("model_check", "demo"),
    ("cli", "__init__"),  # the front doors: the command line and the package's public names
)
FLOOR_OF = {unit: level for level, units in enumerate(FLOORS) for unit in units}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports_of(path: Path, source: str | None = None) -> list[tuple[str, int]]:
    """(kvwise module imported, line) for every import in `path` that runs, function bodies
    included; `if TYPE_CHECKING:` blocks are for type checkers and never run."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for statement in node.body
        for inner in ast.walk(statement)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((target, node.lineno))
            # `from kvwise.x import y` may name a submodule y: count it, it is what runs
            found += [(f"{target}.{alias.name}", node.lineno) for alias in node.names]
    return [(name, line) for name, line in found if name == "kvwise" or name.startswith("kvwise.")]


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for module, path in modules.items():
        targets = set()
        for name, _ in imports_of(path):
            while name not in modules and "." in name:  # `from a.b import c` where c is a name
                name = name.rpartition(".")[0]
            if name in modules and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def test_every_unit_of_the_package_has_a_floor():
    units = {unit_of(module_name(path)) for path in PACKAGE.rglob("*.py")}
    assert units - FLOOR_OF.keys() == set(), "place new packages in FLOORS (and docs/ARCHITECTURE.md)"


def upward_imports(path: Path, source: str | None = None) -> list[str]:
    module = module_name(path)
    upward = {}  # line -> the module it imports (a `from` line also lists its names)
    for name, line in imports_of(path, source):
        if FLOOR_OF[unit_of(name if name != "kvwise" else "kvwise.__init__")] > FLOOR_OF[unit_of(module)]:
            upward.setdefault(line, name)
    return [f"{path.relative_to(PACKAGE)}:{line} imports {name}" for line, name in upward.items()]


def test_no_module_imports_a_higher_floor():
    assert [found for path in sorted(PACKAGE.rglob("*.py")) for found in upward_imports(path)] == []


def test_the_floor_check_sees_an_import_inside_a_function():
    """Not vacuous: a kv module importing the engine late, in a function body, is caught."""
    path = PACKAGE / "kv" / "store.py"
    late = path.read_text() + "\n\ndef _late():\n    from kvwise.engine.core import EngineCore\n"
    assert upward_imports(path, late) == [f"kv/store.py:{late.count(chr(10))} imports kvwise.engine.core"]


def test_no_import_circle():
    graph = import_graph()
    circles = [component for component in strongly_connected(graph) if len(component) > 1]
    assert circles == []


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of `graph`, iteratively (no recursion limit on long chains)."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def test_the_circle_check_sees_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert [c for c in strongly_connected(graph) if len(c) > 1] == [["a", "b", "c"]]
