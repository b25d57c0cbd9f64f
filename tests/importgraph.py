"""The package's import graph, read from the source with ``ast``; both layering tests use it.

Every ``import`` and ``from ... import`` counts, at module level and inside
functions (a lazy import is still a dependency), relative imports included.
Imports under ``if TYPE_CHECKING:`` are never executed: ``graph`` leaves them
out unless asked (``type_checking=True``). ``from jaxckpt import errors`` is an
edge to the module ``jaxckpt.errors``; ``from jaxckpt import CheckpointManager``
is an edge to the package (``jaxckpt/__init__.py``), which re-exports lazily.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "jaxckpt"


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Every module of ``package`` by dotted name."""
    return {module_name(p, package): p for p in sorted(package.rglob("*.py"))}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    hidden: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            hidden.update(id(n) for n in ast.walk(node))
    return hidden


def imports(module: str, known: dict[str, Path], *, type_checking: bool) -> set[str]:
    """The modules of ``known`` that ``module`` imports (anywhere in the file)."""

    def existing(name: str) -> str:  # ``name`` or its nearest enclosing module
        while name not in known:
            name = name.rpartition(".")[0]
        return name

    path = known[module]
    root = module.split(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    hidden = set() if type_checking else _type_checking_nodes(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.Import):
            found |= {existing(a.name) for a in node.names if a.name.split(".")[0] == root}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package upwards
                package = module if path.name == "__init__.py" else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            if base.split(".")[0] == root:
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    found.add(sub if sub in known else existing(base))
    found.discard(module)
    return found


def graph(package: Path = PACKAGE, *, type_checking: bool = False) -> dict[str, set[str]]:
    """Every module of ``package`` and the modules of ``package`` it imports."""
    known = modules(package)
    return {m: imports(m, known, type_checking=type_checking) for m in known}


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


def unit(module: str) -> str:
    """The node a module belongs to: its subpackage, or itself when directly in ``jaxckpt/``.

    >>> unit("jaxckpt.commit._gc"), unit("jaxckpt.errors"), unit("jaxckpt")
    ('commit', 'errors', 'jaxckpt')
    """
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def unit_graph(
    edges: dict[str, set[str]] | None = None, *, type_checking: bool = False
) -> dict[str, set[str]]:
    """The graph between units (``unit``): each subpackage one node, each top-level module one."""
    edges = graph(type_checking=type_checking) if edges is None else edges
    out: dict[str, set[str]] = {}
    for module, targets in edges.items():
        out.setdefault(unit(module), set()).update(unit(t) for t in targets)
    for node, targets in out.items():
        targets.discard(node)
    return out


def private_module(module: str) -> bool:
    """Whether ``module`` is a private module inside a subpackage (``jaxckpt.commit._gc``)."""
    return module.count(".") >= 2 and module.rpartition(".")[2].startswith("_")


def crossings(edges: dict[str, set[str]] | None = None) -> list[tuple[str, str]]:
    """Every import (module to module) that crosses into another subpackage."""
    edges = graph() if edges is None else edges
    return sorted(
        (module, target)
        for module, targets in edges.items()
        for target in targets
        if unit(target) != unit(module)
        and target.count(".") >= 1
        and (PACKAGE / target.split(".")[1]).is_dir()
    )


def private_imports_of_file(path: Path, package: Path = PACKAGE) -> set[str]:
    """The private modules of ``package`` that a file (a test, a script) imports by name.

    ``jaxckpt.records._step`` counts; ``jaxckpt.records`` (the face) and
    ``jaxckpt.errors`` do not; ``jaxckpt._options`` (a private top-level module) does.
    """
    root = package.name
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] != root:
                continue
            for i in range(1, len(parts)):
                if parts[i].startswith("_") and not parts[i].startswith("__"):
                    if package.joinpath(*parts[1 : i + 1]).with_suffix(".py").exists():
                        found.add(".".join(parts[: i + 1]))
                    break
    return found
