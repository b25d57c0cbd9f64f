"""The peer tier's pure parts: which step a restore heals, the replica index, and how
retention and gc treat replicas on one local root (no processes, no sockets)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxckpt import CheckpointOptions, CorruptCheckpointError
from jaxckpt.records import FileDigest, ReplicaIndex, replica_index_key, replica_prefix
from jaxckpt.tiers import heal_target, open_tier

A = "e1-1700000000-abcdef"


@pytest.mark.parametrize(
    ("reports", "step", "durable", "target"),
    [
        # every process has step 2 itself: nothing to heal
        ([([1, 2], []), ([1, 2], [])], None, None, None),
        # process 1 lost step 2; process 0 holds its replica: heal step 2
        ([([1, 2], [(2, 1, A)]), ([], [(2, 0, A)])], None, None, 2),
        # ... unless the durable root has a newer step
        ([([1, 2], [(2, 1, A)]), ([], [])], None, 3, None),
        # ... or as new: the local one is still healed (restore prefers the nearer tier)
        ([([1, 2], [(2, 1, A)]), ([], [])], None, 2, 2),
        # process 1's part of step 2 is nowhere: not complete
        ([([1, 2], []), ([1], [(2, 0, A)])], None, None, None),
        # 3 lacks process 1's part anywhere: the newest complete step is 2
        ([([2, 3], [(2, 1, A)]), ([], [(3, 0, A)])], None, None, 2),
        # a step asked for explicitly
        ([([2, 3], [(2, 1, A)]), ([], [(3, 0, A)])], 2, None, 2),
        ([([2, 3], [(2, 1, A)]), ([], [(3, 0, A)])], 3, None, None),
    ],
)
def test_heal_target(reports, step, durable, target):
    assert heal_target(reports, step, durable) == target


@pytest.mark.parametrize(
    ("reports", "durable", "below", "target"),
    [
        # step 3 failed: step 2, complete and lacked by process 1, is next
        ([([2, 3], [(2, 1, A), (3, 1, A)]), ([], [(2, 0, A), (3, 0, A)])], None, 3, 2),
        # ... not when the durable root holds something newer than it
        ([([2, 3], [(2, 1, A), (3, 1, A)]), ([], [(2, 0, A), (3, 0, A)])], 3, 3, None),
        # step 2 lacks process 1's part: step 1 is the next complete one
        ([([1, 2, 3], [(1, 1, A), (3, 1, A)]), ([], [(1, 0, A), (2, 0, A)])], None, 3, 1),
        # nothing older is complete
        ([([3], [(3, 1, A)]), ([], [(3, 0, A)])], None, 3, None),
    ],
)
def test_heal_target_below_a_step_that_failed(reports, durable, below, target):
    assert heal_target(reports, None, durable, below=below) == target


def test_replica_index_round_trips_and_detects_damage():
    index = ReplicaIndex(
        step=7,
        process=2,
        attempt=A,
        num_processes=4,
        files={"tree.json": FileDigest(size=3, crc32c=5)},
        metrics={"loss": 0.5},
        keep=True,
        promote='{"step": 7}',
    )
    data = index.to_bytes()
    assert ReplicaIndex.from_bytes(data, "x") == index
    damaged = data.replace(b"[3,5]", b"[4,5]")
    assert damaged != data
    with pytest.raises(CorruptCheckpointError, match="fails its checksum"):
        ReplicaIndex.from_bytes(damaged, "x")


def _replica(storage, step, source):
    storage.write(replica_prefix(step, source) + f"{A}/tree.json", b"{}")
    storage.write(replica_index_key(step, source, A), b"{}")


def test_retention_deletes_a_steps_replicas_and_gc_the_stale_ones(tmp_path):
    import jaxckpt

    local = str(tmp_path / "local")
    with jaxckpt.CheckpointManager(tmp_path / "durable", local_root=local) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": np.arange(4.0)})
            mgr.wait()
    opts = CheckpointOptions(local_root=local, local_replicas=2)
    tier = open_tier(local, opts, "local")
    tier.take_epoch(None, primary=True, gc_grace_s=None)  # type: ignore[arg-type]
    for step in (0, 1, 2, 3, 4):
        _replica(tier.storage, step, source=1)
    tier.delete(2)  # retention's deletion: the step's replicas go with it
    assert not tier.storage.list(replica_prefix(2))
    # gc: replicas of steps not held here and older than the newest held (0) go;
    # a newer one (4) may be a replication in flight and stays, as do those of held steps
    assert tier.peers.collect() == [0]
    assert {k.split("/")[1] for k in tier.storage.list("replicas/")} == {
        f"{s:012d}" for s in (1, 3, 4)
    }
    # a local tier without replicas never touches replicas/
    plain = open_tier(local, CheckpointOptions(local_root=local), "local")
    assert plain.peers.collect() == []


def test_promoter_metrics_report_replica_bytes_and_replication_lag(tmp_path):
    import jaxckpt
    from jaxckpt.cli import PromoterMetrics
    from jaxckpt.commit import CommitProtocol
    from jaxckpt.storage import open_storage

    local, durable = str(tmp_path / "local"), str(tmp_path / "durable")
    with jaxckpt.CheckpointManager(durable, local_root=local, promotion="external") as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": np.arange(4.0)})
    storage = open_storage(local)
    for step, size in ((1, 100), (2, 50)):  # process 1's parts of steps 1 and 2 arrived
        index = ReplicaIndex(
            step=step,
            process=1,
            attempt=A,
            num_processes=2,
            files={"tree.json": FileDigest(size=size, crc32c=0)},
        )
        storage.write(replica_index_key(step, 1, A), index.to_bytes())
    metrics = PromoterMetrics(CommitProtocol(storage), CommitProtocol(open_storage(durable)))
    metrics.refresh()
    value = metrics.registry.get_sample_value
    assert value("jaxckpt_replica_bytes") == 150
    assert value("jaxckpt_replication_lag_steps") == 1  # local step 3, newest replica 2


class _Local:
    """The part of a local tier replication reads: its storage and its URI."""

    def __init__(self, root) -> None:
        from jaxckpt.storage import open_storage

        self.storage = open_storage(str(root))
        self.uri = self.storage.uri


def _peers(tmp_path, address: str, **options):
    """A joined ``Peers`` of process 0 whose holder (process 1) listens at ``address``."""
    from jaxckpt.tiers._peers import Peers
    from jaxckpt.tiers._placement import place
    from jaxckpt.tiers._transport import new_secret

    opts = CheckpointOptions(
        local_root=str(tmp_path / "local"), local_replicas=2, peer_timeout_s=60.0, **options
    )
    peers = Peers(_Local(tmp_path / "local"), opts)  # type: ignore[arg-type]
    peers.placement = place(["node0", "node1"], 2)
    peers.addresses = ["127.0.0.1:9", address]
    peers._secret = new_secret()
    return peers


def _dead_address() -> str:
    import socket

    with socket.create_server(("127.0.0.1", 0)) as s:  # closed again: refused
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_a_replication_failure_leaves_the_step_not_replicated_not_failed(tmp_path, caplog):
    """A holder that cannot be reached costs the step its copy there (logged, counted;
    a restore heals it), not the save, unless strict replication was asked for."""
    from jaxckpt import PeerError
    from jaxckpt.records._keys import StepLocation

    loc = StepLocation(7, A)
    peers = _peers(tmp_path, _dead_address())
    with caplog.at_level("WARNING", logger="jaxckpt"):
        peers.replicate(loc, metrics=None, keep=False)  # returns: the save goes on
    assert peers.not_replicated == 1
    said = caplog.text
    assert "step 7 is not replicated to process 1 (node node1" in said, said
    assert "strict_replication" in said, said

    # The holder is back: the next replication sends the owed copy first.
    from jaxckpt.records._keys import replica_index_key
    from jaxckpt.storage import open_storage
    from jaxckpt.tiers._transport import PeerServer

    local = peers._local.storage
    for step in (7, 8):
        local.write(StepLocation(step, A).key("manifest/0.json"), b"part %d" % step)
    holder = open_storage(str(tmp_path / "holder"))
    server = PeerServer(holder, peers._secret, timeout_s=60.0)
    try:
        peers.addresses[1] = server.address
        peers.replicate(StepLocation(8, A), metrics=None, keep=False)
    finally:
        server.close()
    assert holder.read(replica_index_key(7, 0, A)) is not None  # healed
    assert holder.read(replica_index_key(8, 0, A)) is not None
    assert peers.not_replicated == 1 and not peers._owed

    strict = _peers(tmp_path, _dead_address(), strict_replication=True)
    with pytest.raises(PeerError, match="replicating process 0's part to process 1"):
        strict.replicate(loc, metrics=None, keep=False)
    assert strict.not_replicated == 0
    with pytest.raises(ValueError, match="strict_replication"):
        CheckpointOptions(strict_replication=1)  # type: ignore[arg-type]


def test_a_failed_steps_replicas_and_owed_copies_are_withdrawn(tmp_path):
    """A save that failed everywhere never commits: the replicas of it a holder keeps (newer
    than its own newest step, so gc keeps them) and the copies of it owed to a holder
    that was down took the room a full disk's next save needed; withdrawing the step
    removes the first and forgets the second."""
    from jaxckpt.records._keys import StepLocation

    peers = _peers(tmp_path, _dead_address())
    local = peers._local.storage
    for step in (7, 8):
        local.write(StepLocation(step, A).key("manifest/0.json"), b"part %d" % step)
        peers.replicate(StepLocation(step, A), metrics=None, keep=False)  # holder down: owed
        _replica(local, step, source=1)  # process 1's part, held here
    assert sorted(peers._owed) == [7, 8]
    peers.withdraw(8)
    assert sorted(peers._owed) == [7]  # step 7 committed: still owed
    assert not local.list(replica_prefix(8))
    assert local.list(replica_prefix(7))
    peers.withdraw(9)  # nothing of it here: nothing happens
    assert sorted(peers._owed) == [7] and local.list(replica_prefix(7))


def test_a_holder_whose_own_tier_is_full_refuses_replicas(tmp_path):
    """While this node's own tier is full, others' replicas are refused: each one took the
    room a deleted step had freed, and this node's own save failed again (the game day).
    The sender's step commits without that copy; the copy is sent once there is room."""
    from jaxckpt.records._keys import StepLocation
    from jaxckpt.storage import open_storage
    from jaxckpt.tiers._transport import PeerServer

    holder = open_storage(str(tmp_path / "holder"))
    peers = _peers(tmp_path, "127.0.0.1:9")
    server = PeerServer(holder, peers._secret, timeout_s=60.0)
    peers.addresses[1] = server.address
    local = peers._local.storage
    try:
        for step in (7, 8):
            local.write(StepLocation(step, A).key("manifest/0.json"), b"part %d" % step)
        server.full = "holder is full"
        peers.replicate(StepLocation(7, A), metrics=None, keep=False)
        assert peers.not_replicated == 1 and sorted(peers._owed) == [7]
        assert not holder.list("replicas/")
        server.full = None  # room again: the owed copy goes first
        peers.replicate(StepLocation(8, A), metrics=None, keep=False)
    finally:
        server.close()
    assert holder.read(replica_index_key(7, 0, A)) is not None
    assert holder.read(replica_index_key(8, 0, A)) is not None
