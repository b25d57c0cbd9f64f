"""Modern sharding targets: abstract (eval_shape under jax.set_mesh), typed keys on a
1x1 mesh, uncommitted targets, and sharding errors that name the path. On 4 host
devices, in a child process (the device count is fixed when jax starts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("flax.nnx")

CHILD = Path(__file__).with_name("sharding_child.py")


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("sharding") / "root"
    proc = subprocess.run(
        [sys.executable, str(CHILD), str(root)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_abstract_targets_resolve_against_the_mesh_set(report):
    assert report["nnx_abstract"] == {
        "equal": True,
        "spec": "P('data', 'model')",
        "mesh": {"data": 2, "model": 2},
        "concrete": True,
    }
    assert report["jax_abstract"] == {"spec": "P('data', None)", "shards": 4, "equal": True}


def test_abstract_targets_without_their_mesh_name_the_path(report):
    assert report["no_mesh"].startswith(
        "TreeMismatchError: restore target leaf ['w'] has a sharding on an abstract mesh"
    )
    assert "call restore inside `with jax.set_mesh(mesh):`" in report["no_mesh"]
    assert (
        "{'data': 2, 'model': 2}, but the mesh set now is {'data': 4, 'model': 1}"
        in (report["other_mesh"])
    )


def test_a_sharding_that_does_not_fit_names_the_path_and_the_sharding(report):
    text = report["misfit"]
    assert text.startswith("TreeMismatchError: restore target leaf ['w']: its sharding ")
    assert "spec=P('x',)" in text and "does not fit the saved array (3, 8) float32" in text
    assert report["fits"] == "P('x',)"


def test_typed_key_on_a_one_by_one_mesh(report):
    assert report["key"] == {"target_spec": "P(None,)", "equal": True, "spec": "P(None,)"}


def test_uncommitted_targets_restore_uncommitted(report):
    for name in ("array", "struct"):
        assert report[f"uncommitted_{name}"] == {"committed": False, "sum": 8.0}
