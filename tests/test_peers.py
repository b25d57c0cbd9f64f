"""The peer-replicated local tier: 4 real JAX processes x 1 CPU device, one node each.

Every process has its own local root (``<prefix><i>``) and node
(``JAXCKPT_NODE_ID=node<i>``); ``local_replicas=2`` puts each process's part on
the next node of the ring too (process ``i``'s replica on process ``i + 1 mod
4``). Steps 1-3 are saved locally and step 2 is promoted, so the newest local
step (3) is newer than anything durable. On the ``4x1`` mesh ``x`` and ``y``
are split over the processes and ``z``, ``rep`` and ``count`` are replicated
over all of them (processes 1-3 keep their copies in held parts). Then, with
every process restarted each time:

a. node 0's local tier wiped: process 0 fetches its part of step 3 from
   process 1, re-seeds its local root (and process 3's replica held there comes
   back), and every process restores step 3 bit-exactly; a connection with a
   wrong secret is turned away;
d. node 1's local tier wiped and its only replica (on node 2) corrupted on
   disk: the damage is detected, never committed, and step 2 (not complete
   across the local tiers since node 0 was lost too) is restored bit-exactly
   from the durable root, the log saying so; with ``local_replicas=3`` the other
   replica (node 3) is used instead (a test below); with only older replicas
   intact, the next newest local step is healed (a test below);
b. three of four local tiers wiped: the newest durable step (2);
c. a holder SIGKILLed while its peer replicates to it (strict replication):
   that save fails on the survivors within the bound, and the older step still
   restores.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import harness
import pytest
import test_multihost as mh

import jaxckpt
from jaxckpt.commit import CommitProtocol
from jaxckpt.records import REPLICAS, parse_replica_index_key
from jaxckpt.storage import open_storage

pytestmark = pytest.mark.timeout(300)
PROCS = 4
GROUP = {"processes": PROCS, "devices": 1, "mesh": "4x1"}
LEAVES = ("x", "y", "z", "rep", "count")
NODES = {i: {"JAXCKPT_NODE_ID": f"node{i}"} for i in range(PROCS)}
PEER_TIMEOUT_S = 60.0  # a transfer between live processes: only a hang reaches it
DEAD_PEER_TIMEOUT_S = 5.0  # the peer timeout of the test whose holder is killed
# Above DEAD_PEER_TIMEOUT_S with room to spare: the process that meets a dead peer fails
# on the peer timeout (SaveFailedError), never on its own save timeout.
HOLDER_SAVE_TIMEOUT_S = 10.0


def args(
    local: Path, *more: str, copies: int = 2, peer_timeout_s: float = PEER_TIMEOUT_S
) -> tuple[str, ...]:
    return (
        f"--local-root={local}",
        f"--leaves={','.join(LEAVES)}",
        f"--local-replicas={copies}",
        f"--peer-timeout={peer_timeout_s:g}",
        *more,
    )


def replicas(local: Path, i: int) -> set[tuple[int, int]]:
    """The (step, source process) replicas process ``i``'s local root holds, complete."""
    keys = open_storage(f"{local}{i}").list(REPLICAS)
    return {(h[0], h[1]) for h in map(parse_replica_index_key, keys) if h is not None}


def restore(tmp_path: Path, root: str, local: Path, *more: str, copies: int = 2) -> list[mh.Proc]:
    extra = args(local, *more, copies=copies)
    procs = mh.restore(tmp_path, root, extra=extra, env_for=NODES, **GROUP)
    for p in procs:
        assert p.said("CHECKED") == ["CHECKED 5"], p.report()  # 5 arrays, 1 shard each
    return procs


def ls_copies(root: str, local: Path, capsys: pytest.CaptureFixture[str]) -> dict[int, Any]:
    """``jaxckpt ls --json`` over every node's local root: each step's copies per part."""
    from jaxckpt import cli

    locals_ = [a for i in range(PROCS) for a in ("--local-root", f"{local}{i}")]
    assert cli.main(["ls", root, *locals_]) == 0
    assert "COPIES (PROCESS:N)" in capsys.readouterr().out
    assert cli.main(["ls", root, *locals_, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["committed"]
    return {c["step"]: (c["tiers"], c["copies"]) for c in listed}


def test_lose_nodes_restore_from_peers_then_from_the_durable_root(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, local = str(tmp_path / "durable"), tmp_path / "local"
    procs = mh.run_group(
        tmp_path,
        root,
        mode="save",
        steps=(1, 2, 3),
        extra=args(local, "--promote-every=2", "--local-keep=2"),
        env_for=NODES,
        **GROUP,
    )
    for p in procs:
        assert p.said("COMMITTED") == [f"COMMITTED {s}" for s in (1, 2, 3)], p.report()
    assert mh.committed_steps(root) == [2]
    for i in range(PROCS):  # each part on its own node and the next; retention took step 1
        assert CommitProtocol(open_storage(f"{local}{i}")).visible_refs().keys() == {2, 3}
        assert replicas(local, i) == {(2, (i - 1) % PROCS), (3, (i - 1) % PROCS)}
    two = {str(p): 2 for p in range(PROCS)}
    assert ls_copies(root, local, capsys) == {2: (["local", "durable"], two), 3: (["local"], two)}

    # (a) node 0 lost: its part of step 3 comes back from node 1, bit-exact.
    shutil.rmtree(f"{local}0")
    assert ls_copies(root, local, capsys)[3] == (["local"], {"0": 1, "1": 2, "2": 2, "3": 1})
    procs = restore(tmp_path, root, local, "--probe-wrong-secret")
    assert mh.restored_steps(procs) == [3] * PROCS
    assert procs[0].said("HEALED") == ["HEALED"], procs[0].report()
    assert all(p.said("HEALED") == [] for p in procs[1:])
    assert [p.said("TIER") for p in procs] == [["TIER local"]] * PROCS
    assert procs[0].said("PROBE REFUSED") == ["PROBE REFUSED"], procs[0].report()
    assert "does not know the job's secret" in procs[1].stderr()
    assert CommitProtocol(open_storage(f"{local}0")).visible_refs().keys() == {3}
    assert (3, 3) in replicas(local, 0)  # process 3's replica on node 0 sent again
    assert not any(
        k.startswith("replicas/000000000009") for k in open_storage(f"{local}1").list("")
    )

    # (d) node 1 lost and its only replica of step 3 (on node 2) corrupted on disk. Step 2
    # is not complete across the local tiers either (process 0's part of it was on nodes 0
    # and 1, both lost since): the durable root, and the log says so.
    shutil.rmtree(f"{local}1")
    corrupt_replica(local, holder=2, step=3, source=1)
    procs = restore(tmp_path, root, local)
    assert mh.restored_steps(procs) == [2] * PROCS
    assert procs[1].said("REPLICA UNUSABLE") == ["REPLICA UNUSABLE"], procs[1].report()
    assert "does not match its checksum" in procs[1].stderr()
    for p in procs:
        assert (
            "step 3 cannot be healed: no peer holds an intact copy of the part of process 1; "
            "the restore reads the durable root (its newest step is 2)"
        ) in p.stderr(), p.report()
    assert CommitProtocol(open_storage(f"{local}1")).visible_refs().keys() == set()
    assert procs[1].said("TIER") == ["TIER durable"], procs[1].report()

    # (b) three of four nodes lost: the newest durable step.
    for i in range(3):
        shutil.rmtree(f"{local}{i}", ignore_errors=True)
    procs = restore(tmp_path, root, local)
    assert mh.restored_steps(procs) == [2] * PROCS
    assert [p.said("TIER") for p in procs[:3]] == [["TIER durable"]] * 3


def corrupt_replica(local: Path, *, holder: int, step: int, source: int) -> None:
    """Flips a byte of a chunk of ``source``'s replica of ``step`` on ``holder``'s disk."""
    storage = open_storage(f"{local}{holder}")
    prefix = f"{REPLICAS}{step:012d}/{source}/"
    chunk = next(k for k in storage.list(prefix) if "/arrays/x/c" in k or "/packs/" in k)
    data = bytearray(storage.read(chunk) or b"")
    data[0] ^= 0xFF
    storage.write(chunk, bytes(data))


PAIR = {"processes": 2, "devices": 1, "mesh": "2x1"}


def test_a_corrupt_newest_replica_heals_the_next_newest_step_with_nothing_durable(
    tmp_path: Path,
) -> None:
    """2 processes on 2 nodes, steps 1 and 2 saved locally, nothing promoted (external
    promotion, no sidecar). Node 0's local tier is wiped and its replica of step 2 (on
    node 1) damaged: step 1, whose replica is intact, is healed and restored bit-exactly
    on both processes (before: both skipped every local step and, with nothing durable,
    raised StepNotFoundError after logging that an older step would be read)."""
    root, local = str(tmp_path / "durable"), tmp_path / "local"
    extra = args(local, "--promotion=external")
    nodes = {i: NODES[i] for i in range(2)}
    procs = mh.run_group(
        tmp_path, root, mode="save", steps=(1, 2), extra=extra, env_for=nodes, **PAIR
    )
    for p in procs:
        assert p.said("COMMITTED") == ["COMMITTED 1", "COMMITTED 2"], p.report()
    assert mh.committed_steps(root) == []
    assert replicas(local, 1) == {(1, 0), (2, 0)}
    shutil.rmtree(f"{local}0")
    corrupt_replica(local, holder=1, step=2, source=0)
    procs = mh.restore(tmp_path, root, extra=extra, env_for=nodes, **PAIR)
    assert mh.restored_steps(procs) == [1, 1]
    said = (
        "step 2 cannot be healed: no peer holds an intact copy of the part of process 0; "
        "healing step 1 instead"
    )
    for p in procs:
        assert p.said("CHECKED") == ["CHECKED 5"], p.report()  # bit-exact, every leaf
        assert p.said("TIER") == ["TIER local"], p.report()
        assert said in p.stderr(), p.report()
        assert "reads an older step" not in p.stderr()
    assert procs[0].said("REPLICA UNUSABLE") == ["REPLICA UNUSABLE"], procs[0].report()
    assert procs[0].said("HEALED") == ["HEALED"], procs[0].report()
    assert CommitProtocol(open_storage(f"{local}0")).visible_refs().keys() == {1}


def test_a_corrupt_replica_is_detected_and_the_other_copy_used(tmp_path: Path) -> None:
    """local_replicas=3, packed layout: process 1's part (its pack objects and manifest
    part) lives on nodes 1, 2 and 3. Step 1 is chosen for
    promotion but not promoted yet (external promotion, no sidecar) when node 1 is lost
    and the copy on node 2 (tried first) is damaged: the one on node 3 is used, and the
    promotion request comes back with it, so the restarted job (background promotion)
    promotes every part of step 1 once."""
    root, local = str(tmp_path / "durable"), tmp_path / "local"
    extra = args(local, "--promotion=external", copies=3)
    procs = mh.run_group(
        tmp_path,
        root,
        mode="save",
        steps=(1,),
        extra=extra,
        env_for=NODES,
        layout="packed",
        **GROUP,
    )
    assert all(p.said("COMMITTED") == ["COMMITTED 1"] for p in procs)
    assert mh.committed_steps(root) == []
    assert replicas(local, 2) == {(1, 1), (1, 0)} and replicas(local, 3) == {(1, 2), (1, 1)}
    held = open_storage(f"{local}3").list(f"{REPLICAS}000000000001/1/")
    assert any("/packs/1." in k for k in held) and any(k.endswith("manifest/1.json") for k in held)
    shutil.rmtree(f"{local}1")
    corrupt_replica(local, holder=2, step=1, source=1)
    procs = restore(tmp_path, root, local, copies=3)
    assert mh.restored_steps(procs) == [1] * PROCS
    assert procs[1].said("REPLICA UNUSABLE") == ["REPLICA UNUSABLE"], procs[1].report()
    assert procs[1].said("HEALED") == ["HEALED"], procs[1].report()
    assert "from process 3 (node node3" in procs[1].stderr()
    assert [p.said("TIER") for p in procs] == [["TIER local"]] * PROCS
    assert CommitProtocol(open_storage(f"{local}1")).visible_refs().keys() == {1}
    assert (1, 0) in replicas(local, 1) and (1, 3) in replicas(local, 1)  # sent again
    assert mh.committed_steps(root) == [1]  # promoted by the restarted job, node 1 included
    names = CommitProtocol(open_storage(root)).require_marker(1).manifest_names()
    assert sorted(names) == [f"manifest/{i}.json" for i in range(PROCS)]


def test_a_holder_killed_mid_replication_fails_that_save_within_the_bound(
    tmp_path: Path,
) -> None:
    """Process 1 replicates to process 2: process 2 is killed while both pause before
    replicating step 2, then process 1 goes on and meets a dead peer (with strict
    replication: without it, a holder's failure alone leaves a step not replicated,
    see ``test_peertier``)."""
    root, local = str(tmp_path / "durable"), tmp_path / "local"
    resume = tmp_path / "resume"
    resume.mkdir()
    env_for = {
        **NODES,
        1: {**NODES[1], harness.PAUSE_AT: "replicating", harness.RESUME_DIR: str(resume)},
        2: {**NODES[2], harness.PAUSE_AT: "replicating"},
    }
    with mh.spawn(
        tmp_path,
        root,
        mode="save_and_die",
        save_timeout_s=HOLDER_SAVE_TIMEOUT_S,
        env_for=env_for,
        extra=args(local, "--strict-replication", peer_timeout_s=DEAD_PEER_TIMEOUT_S),
        **GROUP,
    ) as procs:
        mh.wait_for_phase(procs[2], "JAXCKPT_PHASE replicating 2", procs)
        harness.wait_until(
            lambda: harness.reached_file(resume, "replicating", 2).exists(),
            what="process 1 before replicating step 2",
            timeout_s=mh.PHASE_TIMEOUT_S,
        )
        harness.kill(procs[2].popen)
        harness.resume(resume, "replicating", 2)
        survivors = [procs[i] for i in (0, 1, 3)]
        mh.wait_all(survivors, timeout_s=HOLDER_SAVE_TIMEOUT_S + mh.LOAD_MARGIN_S)
    for p in survivors:
        assert p.said("COMMITTED") == ["COMMITTED 1"], p.report()
        (failed,) = p.said("FAILED")
        _, error, seconds = failed.split()
        assert error in ("SaveFailedError", "SaveTimeoutError"), p.report()
        assert float(seconds) < HOLDER_SAVE_TIMEOUT_S + mh.LOAD_MARGIN_S, failed
    (failed,) = procs[1].said("FAILED")  # the one that met the dead peer: within its timeout
    assert failed.split()[1] == "SaveFailedError", procs[1].report()
    assert "replicating process 1's part to process 2 (node node2" in procs[1].stderr()
    assert CommitProtocol(open_storage(f"{local}1")).visible_refs().keys() == {1}
    procs = restore(tmp_path, root, local)  # every process again: the older step is intact
    assert mh.restored_steps(procs) == [1] * PROCS
    assert [p.said("TIER") for p in procs] == [["TIER local"]] * PROCS


def test_one_process_cannot_keep_two_copies_on_distinct_nodes(tmp_path: Path) -> None:
    with pytest.raises(jaxckpt.PlacementError, match=r"local_replicas=2 needs 2 distinct nodes"):
        jaxckpt.CheckpointManager(
            tmp_path / "durable", local_root=str(tmp_path / "local"), local_replicas=2
        )
    with pytest.raises(ValueError, match="only with a local_root"):
        jaxckpt.CheckpointOptions(local_replicas=2)
    with pytest.raises(ValueError, match="at least 1"):
        jaxckpt.CheckpointOptions(local_replicas=0, local_root="x")
    with pytest.raises(ValueError, match="peer_timeout_s"):
        jaxckpt.CheckpointOptions(peer_timeout_s=0)


def test_after_healing_an_older_local_step_the_restore_reads_it_not_an_older_durable_one(
    tmp_path: Path,
) -> None:
    """2 processes on 2 nodes, steps 5-7 saved, step 5 promoted (background), the local
    tiers keep 6 and 7. Node 0's local tier is wiped and its only replica of step 7 (on
    node 1) damaged: step 6 is healed onto node 0 and every process restores step 6
    from its local tier (before: the restore's newest-marker shortcut saw the local
    tiers' newest markers disagree, 6 against 7, and read the durable step 5)."""
    root, local = str(tmp_path / "durable"), tmp_path / "local"
    extra = args(local, "--promote-every=5", "--local-keep=2")
    nodes = {i: NODES[i] for i in range(2)}
    procs = mh.run_group(
        tmp_path, root, mode="save", steps=(5, 6, 7), extra=extra, env_for=nodes, **PAIR
    )
    for p in procs:
        assert p.said("COMMITTED") == [f"COMMITTED {s}" for s in (5, 6, 7)], p.report()
    assert mh.committed_steps(root) == [5]
    assert replicas(local, 1) == {(6, 0), (7, 0)}
    shutil.rmtree(f"{local}0")
    corrupt_replica(local, holder=1, step=7, source=0)
    procs = mh.restore(tmp_path, root, extra=extra, env_for=nodes, **PAIR)
    assert procs[0].said("HEALED") == ["HEALED"], procs[0].report()
    assert mh.restored_steps(procs) == [6, 6]
    for p in procs:
        assert p.said("CHECKED") == ["CHECKED 5"], p.report()  # bit-exact, every leaf
        assert p.said("TIER") == ["TIER local"], p.report()
        assert "healing step 6 instead" in p.stderr(), p.report()
    assert CommitProtocol(open_storage(f"{local}0")).visible_refs().keys() == {6}


def test_a_job_resumed_from_an_older_step_saves_again_over_its_abandoned_local_steps(
    tmp_path: Path,
) -> None:
    """2 processes, no peers (local_replicas=1), steps 4-6, step 4 promoted, the local
    tiers keep 5 and 6. Node 1 is replaced (its local tier empty): every process
    restores the durable step 4, and the resumed job saves 5 and 6 again, replacing
    node 0's abandoned copies (before: node 0's save of step 5 raised
    StepAlreadyExistsError on every process, and every restart of the job failed the
    same way; found by the game day)."""
    root, local = str(tmp_path / "durable"), tmp_path / "local"
    extra = args(local, "--promote-every=4", "--local-keep=2", copies=1)
    nodes = {i: NODES[i] for i in range(2)}
    procs = mh.run_group(
        tmp_path, root, mode="save", steps=(4, 5, 6), extra=extra, env_for=nodes, **PAIR
    )
    for p in procs:
        assert p.said("COMMITTED") == [f"COMMITTED {s}" for s in (4, 5, 6)], p.report()
    assert mh.committed_steps(root) == [4]
    node0 = CommitProtocol(open_storage(f"{local}0"))
    before = {s: node0.require_marker(s).location.attempt for s in (5, 6)}
    shutil.rmtree(f"{local}1")
    procs = mh.restore(tmp_path, root, extra=(*extra, "--save-after=5,6"), env_for=nodes, **PAIR)
    assert mh.restored_steps(procs) == [4, 4]
    for p in procs:
        assert p.said("TIER") == ["TIER durable"], p.report()
        assert p.said("COMMITTED") == ["COMMITTED 5", "COMMITTED 6"], p.report()
    after = {s: node0.require_marker(s).location.attempt for s in (5, 6)}
    assert all(after[s] != before[s] for s in (5, 6)), (before, after)
    assert "newer than the step restored" in procs[0].stderr(), procs[0].report()
    node1 = CommitProtocol(open_storage(f"{local}1"))
    assert sorted(node1.visible_refs()) == [5, 6]
