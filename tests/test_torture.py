"""The torture run (``scripts/torture.py``), short, plus the bugs it found, reduced.

``test_short_torture_run`` runs every scenario (kill, zombie, race, faults)
on every backend once and requires zero violations. The other tests are the
minimal reproductions of violations the torture run found:

* a commit marker whose create-only write landed but whose response was lost
  (a reset connection): the retry is refused because the marker exists, and
  the writer must recognise its own marker instead of reporting "committed by
  another writer" and deleting the data the marker names;
* a new writer's garbage collection on open must not fail while a fenced
  writer is still writing into the attempt being collected.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import faultproxy
import numpy as np
import pytest
from triggers import SCRIPT_HANG_S

import jaxckpt
from jaxckpt.commit import CommitProtocol
from jaxckpt.records import ATTEMPTS, COMMITS, PENDING, StepLocation, json_record, new_attempt
from jaxckpt.storage import open_storage

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _state(step: int) -> dict[str, Any]:
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal((64, 32), dtype=np.float32), "step": step}


# -- the short run ------------------------------------------------------------------


@pytest.mark.timeout(SCRIPT_HANG_S + 300)
def test_short_torture_run(tmp_path: Path) -> None:
    """Every scenario on every backend once (faults on S3 and GCS): no violation.

    The 11 rounds are the budget: the time budget is one only a hang reaches (3 minutes
    ended a loaded machine's run before its last scenario)."""
    out = tmp_path / "torture.json"
    minutes = f"{SCRIPT_HANG_S / 60:g}"
    argv = [sys.executable, str(SCRIPTS / "torture.py"), "--rounds", "11", "--minutes", minutes]
    argv += ["--seed", "11", "--kib", "64", "--restarted-steps", "2", "--faults-steps", "3"]
    argv += ["--json", str(out), "--workdir", str(tmp_path / "w")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=SCRIPT_HANG_S + 120)
    report = json.loads(out.read_text()) if out.exists() else {}
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert report["violations"] == []
    rows = {(r["backend"], r["scenario"]): r for r in report["table"]}
    expected = {(b, s) for b in ("local", "s3", "gcs") for s in ("kill", "zombie", "race")}
    expected |= {("s3", "faults"), ("gcs", "faults")}
    assert set(rows) == expected, sorted(rows)
    for (backend, scenario), row in rows.items():
        assert row["rounds"] >= 1, row
        if scenario == "kill":
            assert row["kills"] > 0, row  # (it may land before the first commit)
        else:
            assert row["steps_verified"] > 0, row
        if scenario == "zombie":
            assert row["fenced_writers"] > 0, row  # the zombie was fenced
        if scenario == "race":
            assert row["contested_steps"] > 0, row  # both writers tried the same step
        if backend != "local" and scenario == "faults":
            assert sum(row["faults"].values()) > 0, row
    injected = report["totals"]["faults"]
    assert all(injected.get(kind, 0) > 0 for kind in faultproxy.FAULT_KINDS), injected


# -- reductions of what it found ------------------------------------------------------


@pytest.mark.timeout(120)
def test_lost_marker_response_still_commits(
    object_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The marker PUT lands, its response is lost, the retry finds the marker: committed."""
    storage = open_storage(object_root)
    direct = {
        k: os.environ[k]
        for k in ("AWS_ENDPOINT_URL_S3", "STORAGE_EMULATOR_HOST")
        if k in os.environ
    }
    variable = "AWS_ENDPOINT_URL_S3" if object_root.startswith("s3://") else "STORAGE_EMULATOR_HOST"
    proxy = faultproxy.FaultProxy(direct[variable])
    try:
        method = "PUT" if variable == "AWS_ENDPOINT_URL_S3" else "POST"
        proxy.inject("lost", method=method, path_contains=COMMITS)
        monkeypatch.setenv(variable, proxy.endpoint)
        with jaxckpt.CheckpointManager(object_root) as mgr:
            mgr.save(1, _state(1))
            mgr.wait()
        assert proxy.snapshot()["lost"] == 1, "the fault was not injected"
    finally:
        monkeypatch.setenv(variable, direct[variable])
        proxy.close()
    open_storage(object_root)  # points TensorStore's GCS driver back at the server
    reader = jaxckpt.CheckpointManager(object_root, read_only=True)
    assert reader.steps() == [1]
    restored = reader.restore(1)
    np.testing.assert_array_equal(restored["w"], _state(1)["w"])
    assert reader.verify(1).ok
    assert storage.list(PENDING) == []


@pytest.mark.timeout(120)
def test_gc_on_open_tolerates_a_fenced_writer_still_writing(tmp_path: Path) -> None:
    """A zombie keeps writing its step's chunks (7 leaves of 64 chunks, 8 files each,
    over and over: a fenced writer retrying them) while new writers open and collect
    its attempt."""
    root = str(tmp_path / "root")
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(1, _state(1))
    storage = open_storage(root)
    zombie = StepLocation(2, new_attempt(1))
    stop = threading.Event()

    def write_like_a_zombie() -> None:
        n = 0
        while not stop.is_set():
            chunk = str(n // 7 % 64)
            directory = os.path.join(root, zombie.arrays_prefix, f"leaf{n % 7}", "c", chunk)
            n += 1
            try:
                os.makedirs(directory, exist_ok=True)
                for i in range(8):
                    with open(os.path.join(directory, str(i)), "wb") as f:
                        f.write(b"x")
            except (FileNotFoundError, FileExistsError):
                # the collector removed the directory under it: os.makedirs raises
                # FileExistsError when it is removed between its mkdir and its isdir check
                continue

    for i in range(8):  # leftover chunks of the zombie, before it goes on writing
        os.makedirs(os.path.join(root, zombie.arrays_prefix, "old", "c", str(i)), exist_ok=True)
    thread = threading.Thread(target=write_like_a_zombie, daemon=True)
    thread.start()
    try:
        for _ in range(15):
            storage.write(zombie.pending_key, json_record(operation="save", started=time.time()))
            with jaxckpt.CheckpointManager(
                root
            ) as mgr:  # takes an epoch, collects epoch 1's attempt
                assert mgr.steps() == [1]
    finally:
        stop.set()
        thread.join(timeout=10)
    storage.write(zombie.arrays_prefix + "late/c/0", b"x")  # one last chunk, after the opens
    with jaxckpt.CheckpointManager(root) as mgr:  # collects on open, or in garbage_collect
        mgr.garbage_collect(older_than_s=0)
    assert [k for k in storage.list(ATTEMPTS) if k.startswith(zombie.prefix)] == []
    assert storage.read(zombie.pending_key) is None
    assert CommitProtocol(storage).committed().keys() == {1}


@pytest.mark.timeout(120)
def test_failed_pending_cleanup_after_the_marker_keeps_the_step(
    object_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The marker is written; removing the pending record then fails: still committed, intact."""
    storage = open_storage(object_root)
    s3 = object_root.startswith("s3://")
    variable = "AWS_ENDPOINT_URL_S3" if s3 else "STORAGE_EMULATOR_HOST"
    direct = os.environ[variable]
    proxy = faultproxy.FaultProxy(direct)
    try:
        monkeypatch.setenv(variable, proxy.endpoint)
        options = {"max_retries": 2, "initial_delay_s": 0.01, "max_delay_s": 0.02}
        with jaxckpt.CheckpointManager(object_root, storage_options=options) as mgr:
            mgr.save(1, _state(1))
            proxy.inject("error", method="DELETE", path_contains=PENDING, times=50)
            mgr.wait()  # committed: a leftover pending record is garbage, not a failure
        assert proxy.snapshot()["error"] > 0, "the fault was not injected"
    finally:
        monkeypatch.setenv(variable, direct)
        proxy.close()
    open_storage(object_root)  # points TensorStore's GCS driver back at the server
    reader = jaxckpt.CheckpointManager(object_root, read_only=True)
    assert reader.steps() == [1]
    np.testing.assert_array_equal(reader.restore(1)["w"], _state(1)["w"])
    assert reader.verify(1).ok
    with jaxckpt.CheckpointManager(object_root) as writer:  # gc on open: the stale record goes
        assert writer.steps() == [1]
    assert storage.list(PENDING) == []
