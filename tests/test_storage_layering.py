"""The storage package's imports, from the source (``ast``): one way down, no circle.

Every import counts, at module level or inside a function (a lazy import is
still a dependency), and ``if TYPE_CHECKING:`` imports too.
"""

from __future__ import annotations

import ast
import graphlib
import subprocess
import sys
from pathlib import Path

from importgraph import PACKAGE, graph

STORAGE = "jaxckpt.storage"
ALLOWED_OUTSIDE = {"jaxckpt.errors", "jaxckpt._pools"}


def storage_modules(g: dict[str, set[str]]) -> list[str]:
    return [m for m in g if m == STORAGE or m.startswith(STORAGE + ".")]


def test_the_storage_package_has_its_modules() -> None:
    g = graph(type_checking=True)
    assert {f"{STORAGE}.{m}" for m in ("_base", "_buffers", "_local", "_object")} <= set(g)
    for old in ("_storage", "_objectstore", "_ranged", "_httpread"):
        assert f"jaxckpt.{old}" not in g, f"jaxckpt/{old}.py should live in jaxckpt/storage/"


REMOVED = {"_storage", "_objectstore", "_ranged", "_httpread"}


def test_nothing_imports_the_removed_storage_modules() -> None:
    """Not even tests or scripts: an old module of that name elsewhere on the path (an
    editable install of another checkout) would be imported silently instead."""
    found = []
    for path in [*PACKAGE.rglob("*.py"), *(PACKAGE.parent / d for d in ("tests", "scripts"))]:
        for file in [path] if path.suffix == ".py" else sorted(path.rglob("*.py")):
            for node in ast.walk(ast.parse(file.read_text(), str(file))):
                if isinstance(node, ast.ImportFrom) and node.module == "jaxckpt":
                    names = {a.name for a in node.names}
                elif isinstance(node, ast.ImportFrom | ast.Import):
                    modules = [node.module] if isinstance(node, ast.ImportFrom) else []
                    modules += [a.name for a in node.names] if isinstance(node, ast.Import) else []
                    names = {m.split(".")[1] for m in modules if m and m.startswith("jaxckpt.")}
                else:
                    continue
                if names & REMOVED:
                    found.append(f"{file.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert found == [], f"imports of modules now in jaxckpt/storage/: {found}"


def test_storage_imports_only_storage_errors_and_pools() -> None:
    g = graph(type_checking=True)
    for module in storage_modules(g):
        outside = {m for m in g[module] if not m.startswith(STORAGE) and m not in ALLOWED_OUTSIDE}
        assert not outside, f"{module} imports {sorted(outside)}"


def test_pools_import_nothing_of_jaxckpt() -> None:
    assert graph(type_checking=True)["jaxckpt._pools"] == set()


def test_the_storage_package_has_no_import_circle() -> None:
    g = graph(type_checking=True)
    inside = storage_modules(g)
    # The package's __init__ imports its modules; the modules must not need it back.
    sub = {m: {d for d in g[m] if d in inside} for m in inside}
    list(graphlib.TopologicalSorter(sub).static_order())  # raises CycleError on a circle
    for module in inside:
        assert STORAGE not in sub[module] or module == STORAGE, (
            f"{module} imports the package {STORAGE} (the factory): import its module instead"
        )


CLOUDS = {f"{STORAGE}._s3", f"{STORAGE}._gcs"}


def test_only_the_factory_imports_the_backends() -> None:
    """The backend table is the one place a backend is chosen; the object-store base is
    imported by it and by the one class per cloud built on it, nothing else."""
    g = graph(type_checking=True)
    backends = {f"{STORAGE}._local", *CLOUDS}
    base = f"{STORAGE}._object"
    for module, deps in g.items():
        if module != STORAGE:
            assert not deps & backends, f"{module} imports {sorted(deps & backends)}"
            assert base not in deps or module in CLOUDS, f"{module} imports {base}"
    assert all(base in g[cloud] for cloud in CLOUDS)


def test_the_object_store_base_layers_are_imported_only_inside_it() -> None:
    """The base's layers (requests, create-only writes) are built on one another and
    imported by the base and the clouds only: one object-store base, not three."""
    g = graph(type_checking=True)
    layers = [f"{STORAGE}._objrequests", f"{STORAGE}._objcreate", f"{STORAGE}._object"]
    for module, deps in g.items():
        used = deps & set(layers)
        if module == STORAGE:  # the package names the base's class (lazily), nothing below it
            assert used <= {layers[-1]}, sorted(used)
        elif used and module not in CLOUDS:
            assert module in layers, f"{module} imports {sorted(used)}"
            assert all(layers.index(d) < layers.index(module) for d in used), module


def test_the_graph_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    """Function-level and relative imports count: the checks cannot be dodged by either."""
    package = tmp_path / "jaxckpt"
    (package / "storage").mkdir(parents=True)
    for name in ("__init__", "_manager", "_tiers", "errors", "storage/__init__"):
        (package / f"{name}.py").write_text("")
    (package / "storage" / "_x.py").write_text(
        "from .. import errors\n"
        "def f():\n    from jaxckpt import _manager\n    import jaxckpt._tiers\n"
    )
    deps = graph(package, type_checking=True)["jaxckpt.storage._x"]
    assert deps == {"jaxckpt._manager", "jaxckpt._tiers", "jaxckpt.errors"}


def test_listing_a_local_root_does_not_import_the_object_store() -> None:
    code = (
        "import sys, jaxckpt.cli._ls, jaxckpt.storage;"
        "print(sorted(m for m in ('tensorstore', 'jaxckpt.storage._object', 'jaxckpt.storage._s3',"
        " 'jaxckpt.storage._gcs') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
