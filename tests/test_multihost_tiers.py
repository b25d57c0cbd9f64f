"""Tiers on several hosts: 2 real JAX processes x 2 CPU devices, one local tier each.

Each process saves to its own local root (``<prefix>0``, ``<prefix>1``) and
commits its own part there; promotion puts every host's part into one durable
attempt, committed by the primary's promoter once every part is present. On
the ``2x2`` mesh (``data`` across the processes) ``x`` and ``y`` are split
between the processes, while ``z``, ``rep`` and ``count`` are replicated
across them: their ``replica_id == 0`` copies are process 0's, so process 1
keeps its copies in a *held* part of its local tier, which makes each local
tier hold every region its process reads back (the numpy leaf, saved by the
primary only, is left out). Checked:

a. background promotion onto S3 and GCS: every host's part in the one durable step,
   each local tier holds its own part only, no request left; one host's
   corrupt local chunk makes that host read the durable copy while the other
   reads its local one, both bit-exact;
b. external promotion: one ``jaxckpt promote`` per host, run at once (the
   primary's commits); then one host's local tier wiped (a replaced node):
   it reads the durable copy, the other its local one.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import test_multihost as mh
from benchkit import servers
from rootpaths import chunk_path

import jaxckpt
from jaxckpt.commit import CommitProtocol
from jaxckpt.records import read_requests
from jaxckpt.storage import open_storage

pytestmark = pytest.mark.timeout(300)
STEPS = mh.STEPS
GROUP = {"processes": 2, "devices": 2, "mesh": "2x2"}
LEAVES = ("x", "y", "z", "rep", "count")


def tiers(local: Path, promotion: str) -> tuple[str, ...]:
    return (f"--local-root={local}", f"--promotion={promotion}", f"--leaves={','.join(LEAVES)}")


def save(tmp_path: Path, root: str, local: Path, promotion: str, *more: str) -> list[mh.Proc]:
    extra = (*tiers(local, promotion), *more)
    procs = mh.run_group(tmp_path, root, mode="save", extra=extra, **GROUP)
    for p in procs:
        assert p.said("COMMITTED") == [f"COMMITTED {s}" for s in STEPS], p.report()
    for i in range(2):  # each local tier commits its own part only
        protocol = CommitProtocol(open_storage(f"{local}{i}"))
        for step in STEPS:
            marker = protocol.require_marker(step)
            held = ["manifest/1.held.json"] if i == 1 else []  # process 1's replicas
            names = marker.manifest_names()
            assert sorted(names) == sorted([f"manifest/{i}.json", *held]), names
            assert set(marker.files) == {"tree.json"}, marker.files  # the parts check themselves
        with jaxckpt.CheckpointManager(f"{local}{i}", read_only=True) as mgr:
            report = mgr.verify(STEPS[-1])  # one host's part, held replicas included
            assert report.ok and report.chunks_checked > 0, report
    return procs


def restore_tiers(
    tmp_path: Path, root: str, local: Path, promotion: str, *more: str
) -> tuple[list[str], list[mh.Proc]]:
    """Restores in a group; returns where each process read from (both restore step 2)."""
    procs = mh.restore(tmp_path, root, extra=(*tiers(local, promotion), *more), **GROUP)
    assert mh.restored_steps(procs) == [STEPS[-1]] * 2
    for p in procs:
        assert p.said("CHECKED") == ["CHECKED 10"], p.report()  # 5 arrays, 2 shards each
    assert procs[0].said("AGREEMENT KEYS LEFT") == ["AGREEMENT KEYS LEFT 0"], procs[0].report()
    tiers_read = []
    for p in procs:
        (line,) = p.said("TIER")
        tiers_read.append(line.split()[1])
    return tiers_read, procs


def check_durable(root: str) -> None:
    """Every host's part is in the durable step (each chunk in one part, held
    replicas not promoted), and it restores bit-exactly."""
    protocol = CommitProtocol(open_storage(root))
    assert sorted(protocol.committed()) == list(STEPS)
    for step in STEPS:
        marker = protocol.require_marker(step)
        assert marker.num_processes == 2
        assert sorted(marker.manifest_names()) == [
            "manifest/0.json",
            "manifest/1.json",
        ]
        owners: dict[tuple[str, str], int] = {}
        for part in protocol.read_manifest(marker):
            for name, records in part.arrays.items():
                for r in records:
                    assert owners.setdefault((name, r.key), part.process) == part.process
        prefix = marker.location.arrays_prefix
        stored = {
            tuple(k[len(prefix) :].split("/", 1))
            for k in protocol.storage.list(prefix)
            if "/c" in k[len(prefix) :]
        }
        assert stored == set(owners)  # every chunk once, nothing else
        assert {n for n, _ in owners} == set(LEAVES)
        assert {p for (n, _), p in owners.items() if n in ("rep", "count")} == {0}
        with jaxckpt.CheckpointManager(root, read_only=True) as mgr:
            restored = mgr.restore(step)
        for name in LEAVES:
            np.testing.assert_array_equal(restored[name], mh.child.expected(name, step))
            assert restored[name].dtype == mh.child.expected(name, step).dtype


def test_background_promotion_to_an_object_store_and_a_corrupt_local_chunk(
    object_root: str, tmp_path: Path
) -> None:
    root = object_root
    local = tmp_path / "local"
    for p in save(tmp_path, root, local, "background"):
        assert p.said("DURABLE") == [f"DURABLE {STEPS[-1]}"], p.report()
    check_durable(root)
    for i in range(2):
        assert read_requests(CommitProtocol(open_storage(f"{local}{i}"))) == {}
    # x's first chunk (rows 0:4, on device 0) is in process 0's local tier only.
    servers.corrupt_object(chunk_path(f"{local}0", STEPS[-1], "x", 0, 0))
    assert restore_tiers(tmp_path, root, local, "background")[0] == ["durable", "local"]


def test_external_promotion_one_sidecar_per_host_and_a_wiped_local_tier(tmp_path: Path) -> None:
    """Also ``CheckpointManager.compile``: each process keeps its compiled step in its local
    tier; after the restart the kept one loads, the replaced node's compiles again."""
    root, local = str(tmp_path / "durable"), tmp_path / "local"
    for p in save(tmp_path, root, local, "external", "--compile"):
        assert p.said("COMPILED") == ["COMPILED loaded=0 compiled=1"], p.report()
    assert CommitProtocol(open_storage(root)).committed() == {}  # nobody promoted yet
    sidecars = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jaxckpt",
                "promote",
                f"{local}{i}",
                root,
                "--parts-timeout",
                str(mh.RUN_TIMEOUT_S),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = []
    for proc in sidecars:
        out, err = proc.communicate(timeout=mh.RUN_TIMEOUT_S)
        assert proc.returncode == 0, err
        outs.append(out)
    assert "promoted 2 steps" in outs[0], outs  # the primary's sidecar commits ...
    assert "step 2: part uploaded" in outs[1], outs  # ... the other uploads its part
    check_durable(root)
    locals_ = [CommitProtocol(open_storage(f"{local}{i}")) for i in range(2)]
    assert read_requests(locals_[0]) == {}
    assert sorted(read_requests(locals_[1])) == list(STEPS)  # uploaded, committed by the other
    rerun = subprocess.run(
        [sys.executable, "-m", "jaxckpt", "promote", f"{local}1", root],
        capture_output=True,
        text=True,
        timeout=mh.RUN_TIMEOUT_S,
    )
    assert rerun.returncode == 0 and "promoted 0 steps" in rerun.stdout, rerun.stderr
    assert read_requests(locals_[1]) == {}  # durable now: its requests are dropped
    shutil.rmtree(f"{local}1")  # a replaced node
    read, procs = restore_tiers(tmp_path, root, local, "external", "--compile")
    assert read == ["local", "durable"]
    assert [p.said("COMPILED") for p in procs] == [
        ["COMPILED loaded=1 compiled=0"],
        ["COMPILED loaded=0 compiled=1"],
    ], [p.report() for p in procs]


def test_a_failed_multi_host_save_is_never_promoted(tmp_path: Path) -> None:
    """Process 1 is SIGKILLed before its local commit of step 2; process 0 wrote its
    own part, then its save times out waiting for process 1's: it never commits step 2
    locally nor requests its promotion, so no promoter waits for it."""
    root, local = str(tmp_path / "durable"), tmp_path / "local"
    pause = {mh.child.PAUSE_ENV: "data_written", "JAXCKPT_PAUSE_S": "300"}
    with mh.spawn(
        tmp_path,
        root,
        mode="save_and_die",
        save_timeout_s=mh.DIE_SAVE_TIMEOUT_S,
        env_for={1: pause},
        extra=tiers(local, "external"),
        **GROUP,
    ) as procs:
        target, survivor = procs[1], procs[0]
        mh.wait_for_phase(target, f"JAXCKPT_PHASE data_written {STEPS[1]}", procs)
        mh.kill_and_outlive(
            target,
            survivor,
            mh.DIE_SAVE_TIMEOUT_S + mh.LOAD_MARGIN_S,
            "process 0 hangs after its peer died",
        )
    assert survivor.popen.returncode == 0, survivor.report()
    (failed,) = survivor.said("FAILED")
    assert failed.split()[1] == "SaveTimeoutError", survivor.report()
    local0 = CommitProtocol(open_storage(f"{local}0"))
    assert sorted(local0.committed()) == [STEPS[0]]  # every host's part comes first
    assert sorted(read_requests(local0)) == [STEPS[0]]  # step 2 is not to be promoted
    local1 = CommitProtocol(open_storage(f"{local}1"))
    assert sorted(local1.committed()) == [STEPS[0]]


def test_processes_on_one_machine_cannot_share_a_local_tier(tmp_path: Path) -> None:
    """Two processes given one local_root would fence each other there: both refuse
    at construction, naming the root and the processes, and nothing is written."""
    root, local = str(tmp_path / "durable"), tmp_path / "local"
    extra = (*tiers(local, "external"), "--shared-local-root")
    with mh.spawn(tmp_path, root, mode="save", extra=extra, **GROUP) as procs:
        for p in procs:
            try:
                p.popen.wait(timeout=60 + mh.LOAD_MARGIN_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"a process hangs\n{p.report()}")
    for p in procs:
        assert p.popen.returncode != 0, p.report()
        assert p.said("READY") == [], p.report()
        assert f"local_root {str(local)!r} on host" in p.stderr(), p.report()
        assert "processes 0 and 1 of this job share it" in p.stderr(), p.report()
    assert not local.exists()  # refused before the local root was created
    assert not Path(root).exists()


def test_external_promotion_of_a_packed_step_whose_second_host_holds_only_replicas(
    tmp_path: Path,
) -> None:
    """Packed layout, only replicated leaves: process 1 owns no chunk (its copies are in
    its held part). Its sidecar uploads its part and the primary's sidecar commits
    both steps (found by the game day: the commit refused with "holds 1 data objects,
    its manifest parts name 2", so nothing of a data-parallel job became durable)."""
    root, local = str(tmp_path / "durable"), tmp_path / "local"
    extra = (f"--local-root={local}", "--promotion=external", "--leaves=z,rep,count")
    procs = mh.run_group(tmp_path, root, mode="save", extra=extra, layout="packed", **GROUP)
    for p in procs:
        assert p.said("COMMITTED") == [f"COMMITTED {s}" for s in STEPS], p.report()
    wait = ("--parts-timeout", str(mh.RUN_TIMEOUT_S))
    sidecars = [
        subprocess.Popen(
            [sys.executable, "-m", "jaxckpt", "promote", f"{local}{i}", root, *wait],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = [proc.communicate(timeout=mh.RUN_TIMEOUT_S) for proc in sidecars]
    assert [proc.returncode for proc in sidecars] == [0, 0], outs
    assert "promoted 2 steps" in outs[0][0], outs
    assert sorted(CommitProtocol(open_storage(root)).committed()) == list(STEPS)
    with jaxckpt.CheckpointManager(root, read_only=True) as mgr:
        restored = mgr.restore(STEPS[-1])
    for name in ("z", "rep", "count"):
        np.testing.assert_array_equal(restored[name], mh.child.expected(name, STEPS[-1]))
