"""Tiers and retention as components: what a tier reads and writes, what retention keeps."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

import jaxckpt
from jaxckpt import CheckpointOptions, policy
from jaxckpt.commit import Agreement
from jaxckpt.lifecycle import Retention
from jaxckpt.tiers import open_tier, open_tiers


def saved(root: Path, steps: range) -> None:
    with jaxckpt.CheckpointManager(str(root)) as mgr:
        for step in steps:
            mgr.save(step, {"w": np.full(2, step, np.float32)})


def test_open_tiers_names_them_nearest_first_and_refuses_one_root_twice(tmp_path):
    plain = open_tiers(tmp_path / "root", CheckpointOptions())
    assert [(t.name, t.own) for t in plain] == [("durable", False)]
    tiered = open_tiers(tmp_path / "root", CheckpointOptions(local_root=str(tmp_path / "l")))
    assert [(t.name, t.own) for t in tiered] == [("local", True), ("durable", False)]
    assert not (tmp_path / "root").exists() and not (tmp_path / "l").exists()  # opened only
    with pytest.raises(jaxckpt.CheckpointError, match="same root"):
        open_tiers(tmp_path / "r", CheckpointOptions(local_root=str(tmp_path / "r")))
    with pytest.raises(ValueError, match="tier name"):
        open_tier(tmp_path / "root", CheckpointOptions(), "peer")


def test_a_tier_lists_reads_and_deletes_its_steps(tmp_path):
    saved(tmp_path / "root", range(1, 4))
    tier = open_tier(tmp_path / "root", CheckpointOptions(), "durable")
    agreement = Agreement("test-tier", timeout_s=5)
    assert tier.visible() == [1, 2, 3] and sorted(tier.committed()) == [1, 2, 3]
    latest = tier.latest()
    assert latest is not None and latest.step == 3
    assert tier.newest(agreement, primary=True) == 3
    assert tier.newest(agreement, primary=False) is None  # a shared tier: the primary reads
    assert tier.holds(2) and not tier.holds(7)
    epoch = tier.take_epoch(agreement, primary=True, gc_grace_s=None)
    assert tier.protocol.epoch == epoch > 1  # the saving manager held epoch 1
    tier.delete(2)
    assert tier.visible() == [1, 3] and not tier.holds(2)


def test_a_full_disk_still_deletes_a_step(tmp_path, monkeypatch):
    """A deletion announces itself with a pending record; on a disk with no room for it
    the step is deleted anyway (a full local tier could not free a byte)."""
    import errno

    saved(tmp_path / "root", range(1, 4))
    tier = open_tier(tmp_path / "root", CheckpointOptions(), "durable")
    tier.take_epoch(Agreement("test-full", timeout_s=5), primary=True, gc_grace_s=None)
    storage, write = tier.storage, tier.storage.write

    def full(key, data):
        if key.startswith("pending/"):
            raise jaxckpt.StorageError(errno.ENOSPC, f"cannot write {key}: no space left")
        return write(key, data)

    monkeypatch.setattr(storage, "write", full)
    before = sum(1 for _ in (tmp_path / "root").rglob("*") if _.is_file())
    tier.delete(1)
    assert tier.visible() == [2, 3]
    assert sum(1 for _ in (tmp_path / "root").rglob("*") if _.is_file()) < before - 1  # its data


def test_retention_prunes_every_tier_but_never_a_protected_step(tmp_path):
    saved(tmp_path / "root", range(1, 6))
    options = CheckpointOptions(retention=policy.KeepLast(1))
    (tier,) = open_tiers(tmp_path / "root", options)
    tier.take_epoch(Agreement("test-retention", timeout_s=5), primary=True, gc_grace_s=None)
    fenced: list[Exception] = []
    retention = Retention(
        [tier], primary=True, protected=[lambda: {2}, lambda: {3}], on_fenced=fenced.append
    )
    with retention.restoring(4):
        assert retention.protected() == {2, 3, 4}
        retention.committed()
        retention.wait(30)
    assert tier.visible() == [2, 3, 4, 5]  # 1 goes; 2, 3 and 4 were protected
    assert retention.protected() == {2, 3}
    assert retention.explain(tier)[4] == ()  # no rule keeps it any more
    retention.committed()
    retention.close()
    assert tier.visible() == [2, 3, 5] and fenced == []
    retention.committed()  # after close(): nothing is scheduled
    assert tier.visible() == [2, 3, 5]


def test_retention_prunes_while_the_health_marks_do_not_answer_and_closes_in_bounded_time(
    tmp_path, monkeypatch
):
    """The marks live on the durable root; while it does not answer a pass waits for them
    at most ``marks_wait_s``, the last read apply, and the read under way is not sent again;
    passes asked for meanwhile make one; ``close()`` waits only as long as it is told."""
    saved(tmp_path / "root", range(1, 6))
    (tier,) = open_tiers(tmp_path / "root", CheckpointOptions(retention=policy.KeepLast(1)))
    tier.take_epoch(Agreement("test-marks", timeout_s=5), primary=True, gc_grace_s=None)
    answer, reads, passes = threading.Event(), [], []

    def bad() -> set[int]:  # a LIST retried through a storm
        reads.append(time.monotonic())
        answer.wait(60)
        return set()

    retention = Retention([tier], primary=True, protected=[], on_fenced=print, bad=bad)
    retention.marks_wait_s = 0.05
    monkeypatch.setattr(retention, "protected", lambda full=None: passes.append(1) or set())
    for _ in range(5):
        retention.committed()
    retention.wait(30)
    assert tier.visible() == [5]  # pruned with the marks last read (none)
    assert len(reads) == 1 and 1 <= len(passes) <= 2  # five asks: one pass, or two
    retention.close()
    retention = Retention([tier], primary=True, protected=[], on_fenced=print, bad=bad)
    retention.marks_wait_s = 30.0
    retention.committed()  # its first pass waits for the marks, up to 30 s
    began = time.monotonic()
    retention.close(0.2)
    assert time.monotonic() - began < 5
    with pytest.raises(TimeoutError):
        retention.wait(0.1)
    answer.set()
    retention.wait(30)  # the pass under way finished; nothing is scheduled after close()
    retention.committed()
    retention.wait(1)


def test_closing_makes_a_last_pass_for_steps_whose_promotion_ended_since_the_last_commit(
    tmp_path,
):
    """Another host's promoter makes a multi-host step durable; this host's promoter then
    withdraws its request without a retention pass. ``close()`` makes one: before, the
    step and the replicas of it held here stayed (a 2-process test, once under CI's load)."""
    saved(tmp_path / "root", range(1, 4))
    (tier,) = open_tiers(tmp_path / "root", CheckpointOptions(retention=policy.KeepLast(1)))
    tier.take_epoch(Agreement("test-last-pass", timeout_s=5), primary=True, gc_grace_s=None)
    waiting = {1, 2}  # requested for promotion: kept

    retention = Retention([tier], primary=True, protected=[lambda: set(waiting)], on_fenced=print)
    retention.committed()  # step 3's commit
    retention.wait(30)
    assert tier.visible() == [1, 2, 3]
    waiting.clear()  # durable now (the request withdrawn: nobody asks for a pass)
    retention.close(30)
    assert tier.visible() == [3]
