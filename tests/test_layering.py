"""The package's import graph, read with ``ast``: no cycles, and nothing imports the manager.

Every ``import`` and ``from ... import`` counts, at module level and inside
functions (a lazy import is still a dependency). Imports under ``if
TYPE_CHECKING:`` are never executed: they count for the manager rule, not for
cycles. ``from jaxckpt import errors`` is an edge to the module
``jaxckpt.errors``; ``from jaxckpt import CheckpointManager`` is an edge to the
package (``jaxckpt/__init__.py``), which re-exports lazily by name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "jaxckpt"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    hidden: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            hidden.update(id(n) for n in ast.walk(node))
    return hidden


def _existing(name: str) -> str:
    """``name`` or its nearest enclosing module of the package."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def imports(module: str, *, type_checking: bool) -> set[str]:
    """The package's modules that ``module`` imports (anywhere in the file)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    hidden = set() if type_checking else _type_checking_nodes(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.Import):
            found |= {_existing(a.name) for a in node.names if a.name.startswith("jaxckpt")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package upwards
                package = module if path.name == "__init__.py" else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            if base == "jaxckpt" or base.startswith("jaxckpt."):
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    found.add(sub if sub in MODULES else _existing(base))
    found.discard(module)
    return found


def graph(*, type_checking: bool = False) -> dict[str, set[str]]:
    return {m: imports(m, type_checking=type_checking) for m in MODULES}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_module_and_function_level_imports():
    edges = graph()
    assert "jaxckpt._tier" in edges["jaxckpt._manager"]  # module level
    assert "jaxckpt._copy" in edges["jaxckpt._promote"]  # inside a function only
    assert "jaxckpt.errors" in edges["jaxckpt._select"]  # from jaxckpt import errors
    assert "jaxckpt" in edges["jaxckpt.flags"]  # from jaxckpt import CheckpointManager


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    found = cycles(graph())
    assert found == [], f"import cycles: {found}"


@pytest.mark.parametrize("type_checking", [False, True])
def test_nothing_imports_the_manager_but_the_package(type_checking):
    importers = {
        m for m, e in graph(type_checking=type_checking).items() if "jaxckpt._manager" in e
    }
    assert importers <= {"jaxckpt"}, sorted(importers)


def test_the_manager_layer_imports_downwards_only():
    """tier ← select, save, retention, promotion ← manager: nothing below imports above."""
    edges = graph()
    above = {
        "jaxckpt._tier": {
            "jaxckpt._select",
            "jaxckpt._save",
            "jaxckpt._retention",
            "jaxckpt._promotion",
        },
        "jaxckpt._save": {"jaxckpt._retention", "jaxckpt._promotion", "jaxckpt._select"},
        "jaxckpt._retention": {"jaxckpt._save", "jaxckpt._promotion", "jaxckpt._select"},
        "jaxckpt._promotion": {"jaxckpt._save", "jaxckpt._retention", "jaxckpt._select"},
        "jaxckpt._select": {"jaxckpt._save", "jaxckpt._retention", "jaxckpt._promotion"},
    }
    for module, forbidden in above.items():
        assert not edges[module] & forbidden, (module, sorted(edges[module] & forbidden))


def test_no_module_is_over_600_lines():
    sizes = {m: len(p.read_text().splitlines()) for m, p in MODULES.items()}
    assert {m: n for m, n in sizes.items() if n > 600} == {}


def test_the_manager_class_is_at_most_300_lines():
    tree = ast.parse(MODULES["jaxckpt._manager"].read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CheckpointManager"]
    assert cls.end_lineno is not None
    assert cls.end_lineno - cls.lineno + 1 <= 300
