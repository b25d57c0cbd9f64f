"""The package's import graph (``tests/importgraph.py``): no cycles, the layers in order.

Each subpackage is one unit and each module directly in ``jaxckpt/`` is its own;
``LAYERS`` lists them bottom up. A unit imports only from units in layers below
its own (function-level imports count; ``TYPE_CHECKING`` imports do not).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from importgraph import (
    PACKAGE,
    crossings,
    cycles,
    graph,
    modules,
    private_imports_of_file,
    private_module,
    unit,
    unit_graph,
)

MODULES = modules()

LAYERS: list[set[str]] = [
    {"errors", "_pools", "_retentionpolicy", "_openroots", "_lazy"},
    {"_healthpolicy"},  # judging a step from its metrics
    {"policy", "_flagdefs"},
    {"_preemption", "storage"},
    {"records"},  # what is on storage: keys, markers, manifests, tree records, layouts
    {"commit"},  # the commit protocol over the records
    {"formats"},  # the data layouts' writers and readers
    {"_options"},
    {"tiers"},  # a root opened for saving and reading, with its peers
    {"restoring", "saving"},
    {"tools", "planning", "ledger"},  # ledger: the run's events and the goodput report
    {"lifecycle", "health"},  # promotion, retention, archiving; health verdicts and crash loops
    {"_manager"},
    {"workflows", "_disabled"},  # built on the manager: preflight, import and export
    {"cli", "_flagpolicies", "zarr_compat"},
    {"jaxckpt"},
    {"flags", "__main__"},
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def test_the_graph_sees_module_and_function_level_imports():
    edges = graph()
    assert "jaxckpt.tiers" in edges["jaxckpt._manager"]  # module level
    assert "jaxckpt.tools" in edges["jaxckpt.lifecycle._archive"]  # inside a function only
    assert "jaxckpt.errors" in edges["jaxckpt.restoring._select"]  # from jaxckpt import errors
    assert "jaxckpt" in edges["jaxckpt.flags"]  # from jaxckpt import CheckpointManager


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    found = cycles(graph())
    assert found == [], f"import cycles: {found}"


def test_every_unit_has_a_layer():
    assert set(unit_graph()) == set(RANK), set(unit_graph()) ^ set(RANK)


def test_no_cycle_between_units():
    found = cycles(unit_graph())
    assert found == [], f"import cycles between packages: {found}"


def test_units_import_only_from_layers_below():
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in graph().items()
        for target in targets
        if unit(target) != unit(module) and RANK[unit(target)] >= RANK[unit(module)]
    )
    assert upward == []


@pytest.mark.parametrize("type_checking", [False, True])
def test_only_the_layers_above_the_manager_import_it(type_checking):
    importers = {
        unit(m) for m, e in graph(type_checking=type_checking).items() if "jaxckpt._manager" in e
    }
    assert all(RANK[u] > RANK["_manager"] for u in importers), sorted(importers)


def test_no_module_is_over_600_lines():
    sizes = {m: len(p.read_text().splitlines()) for m, p in MODULES.items()}
    assert {m: n for m, n in sizes.items() if n > 600} == {}


def test_the_manager_class_is_at_most_300_lines():
    tree = ast.parse(MODULES["jaxckpt._manager"].read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CheckpointManager"]
    assert cls.end_lineno is not None
    assert cls.end_lineno - cls.lineno + 1 <= 300


def test_no_class_is_over_350_lines():
    """Issue 34's sign: a class past 350 lines holds two concerns; split it by concern."""
    sizes = {}
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                sizes[f"{module}.{node.name}"] = node.end_lineno - node.lineno + 1
    assert {c: n for c, n in sizes.items() if n > 350} == {}


def test_at_most_3_modules_are_over_450_lines():
    sizes = {m: len(p.read_text().splitlines()) for m, p in MODULES.items()}
    big = {m: n for m, n in sizes.items() if n > 450}
    assert len(big) <= 3, sorted(big.items(), key=lambda item: -item[1])


def test_at_most_30_modules_directly_in_the_package():
    """Modules and subpackages directly in ``jaxckpt/`` (a newcomer's first listing)."""
    top = {m for m in MODULES if m.count(".") == 1}
    assert len(top) <= 30, sorted(top)


def test_at_most_a_tenth_of_the_imports_between_packages_name_a_private_module():
    """Another package's ``_module`` is its own: imports between packages name the face."""
    for type_checking in (False, True):
        crossing = crossings(graph(type_checking=type_checking))
        private = [edge for edge in crossing if private_module(edge[1])]
        assert len(crossing) > 100  # (the measure sees the imports)
        assert len(private) <= len(crossing) // 10, private


TESTS = PACKAGE.parent / "tests"
UNIT_TESTS = {
    # Tests named for a concept rather than a module: the unit whose internals they test.
    "test_peer_hardening.py": "tiers",
    "test_peer_stream.py": "tiers",
    "test_httpread.py": "storage",
    "test_storage_contract.py": "storage",
    "test_records.py": "records",
    "test_process_state.py": "records",
    "test_replicated.py": "restoring",
    "test_restore_parts.py": "restoring",
}


def units_tested_by(test: Path) -> set[str]:
    """The units a test file is the unit test of: ``test_gc.py`` of ``commit`` (``_gc``)."""
    stem = test.stem.removeprefix("test_")
    named = {
        unit(m)
        for m in MODULES
        if (name := m.rpartition(".")[2].lstrip("_"))
        and (stem == name or stem.startswith(f"{name}_"))
    }
    declared = {UNIT_TESTS[test.name]} if test.name in UNIT_TESTS else set()
    return named | declared


def test_units_tested_by():
    assert units_tested_by(TESTS / "test_gc.py") == {"commit"}
    assert units_tested_by(TESTS / "test_peer_stream.py") == {"tiers"}
    assert units_tested_by(TESTS / "test_everything_else.py") == set()


def test_at_most_25_test_files_import_a_private_module_of_another_unit():
    """Tests use the faces, except a unit's own tests (which may use its internals)."""
    offenders = {}
    for test in sorted(TESTS.glob("test_*.py")):
        mine = units_tested_by(test)
        others = {m for m in private_imports_of_file(test) if unit(m) not in mine}
        if others:
            offenders[test.name] = sorted(others)
    assert len(offenders) <= 25, offenders


def test_build_md_is_a_reference_of_at_most_900_lines():
    lines = (PACKAGE.parent / "BUILD.md").read_text().splitlines()
    assert len(lines) <= 900, len(lines)


def test_the_product_cites_no_issue_numbers():
    """Issue numbers mean nothing to a reader of the product: say what, not which ticket."""
    root = PACKAGE.parent
    files = [*PACKAGE.rglob("*.py"), *(root / "scripts").rglob("*.py")]
    files += [root / "README.md", root / "BUILD.md"]
    pattern = re.compile(r"[Ii]ssues?\s*#?\d+")
    cited = [
        f"{path.relative_to(root)}:{n}"
        for path in files
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert cited == []
