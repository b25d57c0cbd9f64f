"""Format stability: every committed fixture (tests/fixtures/v*/) restores bit-exactly, forever.

Each fixture is a checkpoint root written by the jaxckpt of its format version
(``tests/fixtures/make_fixture.py``) and the values it must restore to, stored beside it.
A failure here means a change broke reading checkpoints that users already have.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from fixtures.fixture_check import (
    expected_process_state,
    load_expected,
    step_problems,
    target_from,
    version_dirs,
)

import jaxckpt
from jaxckpt import cli

VERSIONS = version_dirs()


@pytest.fixture(params=VERSIONS, ids=[p.name for p in VERSIONS])
def fixture(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, Path]:
    """(the fixture's directory, a private copy of its root)."""
    return request.param, Path(shutil.copytree(request.param / "root", tmp_path / "root"))


def test_there_is_a_fixture_for_every_format_version():
    from jaxckpt.records import FORMAT_VERSION

    # v3 is layout 2 with packed data (manifest parts of version 3, layout="packed"); v4
    # (packed) has parts that check themselves under hashed prefixes, process states and
    # empty containers.
    assert [p.name for p in VERSIONS] == [f"v{v}" for v in range(1, FORMAT_VERSION + 1)]


def test_a_version_1_root_opened_for_writing_keeps_its_steps_and_gains_version_2_ones(
    tmp_path: Path,
) -> None:
    import json

    import numpy as np

    v1 = VERSIONS[0]
    root = Path(shutil.copytree(v1 / "root", tmp_path / "root"))
    expected, arrays = load_expected(v1)
    with jaxckpt.CheckpointManager(root) as mgr:  # takes epoch 1; upgrades the root record
        assert mgr.epoch == 1 and mgr.steps() == [1, 2]
        mgr.save(3, {"w": np.arange(4.0)})
    from jaxckpt.records import FORMAT_VERSION

    record = json.loads((root / "jaxckpt.json").read_bytes())
    assert record["version"] == FORMAT_VERSION  # an older jaxckpt now refuses the root
    reader = jaxckpt.CheckpointManager(root, read_only=True)
    assert reader.steps() == [1, 2, 3] and reader.latest_step() == 3
    for step in (1, 2):  # the format-1 steps are untouched and still bit-exact
        restored = reader.restore(step)
        assert step_problems(restored, expected["steps"][str(step)], arrays, as_jax=False) == []
        assert reader.verify(step).ok
    assert (root / "steps" / "1").is_dir() and (root / "attempts" / "3").is_dir()


def test_every_step_restores_bit_exactly_with_and_without_a_target(fixture):
    version_dir, root = fixture
    expected, arrays = load_expected(version_dir)
    mgr = jaxckpt.CheckpointManager(root, read_only=True)
    assert mgr.steps() == sorted(int(s) for s in expected["steps"])
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    checked = 0
    for step_text, step_expected in expected["steps"].items():
        step = int(step_text)
        plain = mgr.restore(step)
        assert step_problems(plain, step_expected, arrays, as_jax=False) == []
        if "process_state" in step_expected:  # fixtures from v4 on
            assert mgr.restored_process_state == expected_process_state(step_expected)
            assert mgr.process_states(step) == [expected_process_state(step_expected)]
        if "empty_containers" in step_expected:
            empty = plain["empty_containers"]
            assert (empty["dict"], empty["list"], empty["tuple"]) == ({}, [], ())
        target = target_from(plain, step_expected["leaves"], lambda _: device)
        targeted = mgr.restore(step, target=target)
        assert step_problems(targeted, step_expected, arrays, as_jax=True) == []
        meta = mgr.metadata(step)
        assert meta.user_metadata == step_expected["metadata"]
        assert meta.keep is step_expected["keep"]
        assert dict(meta.metrics) == step_expected["metrics"]
        checked += len(step_expected["leaves"])
    assert checked > 80
    newest = expected["steps"][str(max(mgr.steps()))]
    assert step_problems(mgr.restore(), newest, arrays, as_jax=False) == []


def test_sharded_leaves_restore_into_their_saved_shardings_on_four_devices(fixture):
    version_dir, _ = fixture
    script = Path(__file__).parent / "fixtures" / "restore_sharded.py"
    proc = subprocess.run(
        [sys.executable, str(script), str(version_dir)],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.startswith("OK ")


def _snapshot(root: Path) -> dict[str, tuple[str, int]]:
    """Every entry under ``root``: each file's digest, and every mtime (directories too)."""
    out = {}
    for p in sorted(root.rglob("*")):
        digest = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        out[str(p.relative_to(root))] = (digest, p.stat().st_mtime_ns)
    return out


def test_verify_passes_and_reading_writes_nothing(fixture, capsys):
    _, root = fixture
    before = _snapshot(root)
    mgr = jaxckpt.CheckpointManager(root, read_only=True)
    for step in mgr.steps():
        report = mgr.verify(step)
        assert report.ok, report.problems
        assert report.chunks_checked > 30
        mgr.restore(step)
        mgr.metadata(step)
    mgr.close()
    assert cli.main(["verify", str(root), "--all", "--no-progress"]) == 0
    assert cli.main(["ls", str(root), "--json"]) == 0
    assert cli.main(["inspect", str(root), "--json"]) == 0
    assert '"step": 2' in capsys.readouterr().out  # inspect --json of the newest step
    assert _snapshot(root) == before
