"""A durable root in an outage does not stop a job whose local tier holds its step.

moto behind ``scripts/faultproxy.py`` answering every request ``503 SlowDown`` (a
storm that lasts until the test ends it). A tiered manager opened in it waits
``durable_wait_s`` for the durable epoch, then restores the newest step every host
holds locally and trains; steps chosen for promotion meanwhile are requested
unstamped, and once the storm ends the next save adopts the epoch taken in the
background, stamps them, and they are promoted. With nothing local, the restore
waits for the durable root instead. A promoter leaves unstamped requests alone.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import faultproxy
import numpy as np
import pytest
from benchkit import servers
from triggers import HANG_S, wait_until

import jaxckpt
from jaxckpt import policy
from jaxckpt.commit import CommitProtocol
from jaxckpt.ledger import read_ledger
from jaxckpt.lifecycle import Promoter
from jaxckpt.records import UNSTAMPED, read_requests, request_promotion, withdraw
from jaxckpt.storage import open_storage


@pytest.fixture
def proxy(
    s3_server: servers.Server, monkeypatch: pytest.MonkeyPatch
) -> Iterator[faultproxy.FaultProxy]:
    proxy = faultproxy.FaultProxy(s3_server.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint)  # every root of the test
    yield proxy
    proxy.close()


def _state(k: int) -> dict[str, np.ndarray]:
    return {"w": np.arange(4096, dtype=np.float32) + k, "b": np.full(8, k, np.int64)}


def _tiered(root: str, local: Path, proxy: faultproxy.FaultProxy, **kw: object) -> dict:
    return {
        "local_root": str(local),
        "promote_policy": policy.EveryNSteps(20),
        "save_timeout_s": HANG_S,  # an open that waited for the storm would fail after it
        **kw,
    }


def _first_run(root: str, local: Path, proxy: faultproxy.FaultProxy) -> int:
    """Steps 10..40 saved, 20 and 40 promoted; returns the first run's durable epoch."""
    with jaxckpt.CheckpointManager(root, **_tiered(root, local, proxy)) as mgr:
        for step in (10, 20, 30, 40):
            mgr.save(step, _state(step))
        assert mgr.wait_durable(40) == 40
        return mgr._tiers[-1].protocol.epoch


def test_a_job_restarted_in_an_outage_trains_from_its_local_tier_and_promotes_after(
    proxy: faultproxy.FaultProxy, s3_server: servers.Server, tmp_path: Path
) -> None:
    root = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}"
    local = tmp_path / "local"
    first_epoch = _first_run(root, local, proxy)
    proxy.plan = faultproxy.FaultPlan(throttle=1.0)  # until the test ends it
    options = _tiered(root, local, proxy, durable_wait_s=0.5)
    with jaxckpt.CheckpointManager(root, **options) as mgr:
        durable = mgr._tiers[-1]
        assert durable.deferred and durable.protocol.epoch is None
        assert mgr.latest_step() == 40
        restored = mgr.restore()
        assert mgr.restored_step == 40
        np.testing.assert_array_equal(restored["w"], _state(40)["w"])
        for step in (50, 60):  # 60 is chosen for promotion: requested, unstamped
            mgr.save(step, _state(step))
        mgr.wait()
        assert read_requests(mgr._tiers[0].protocol)[60].epoch == UNSTAMPED
        assert proxy.snapshot()["throttle"] > 0
        proxy.plan = faultproxy.NO_FAULTS
        wait_until(lambda: durable.learned() is not None, what="the epoch taken after the storm")
        mgr.save(70, _state(70))  # every host adopts the epoch here; 60 is stamped
        assert not durable.deferred and durable.protocol.epoch > first_epoch
        assert mgr.wait_durable(60) == 60
        assert mgr.ledger.writer is not None and mgr.ledger.writer.epoch == durable.protocol.epoch
    with jaxckpt.CheckpointManager(root, read_only=True) as r:
        assert r.steps() == [20, 40, 60]
        np.testing.assert_array_equal(r.restore(60)["w"], _state(60)["w"])


def test_a_long_outage_keeps_only_the_newest_waiting_steps_locally(
    proxy: faultproxy.FaultProxy, s3_server: servers.Server, tmp_path: Path
) -> None:
    """While the durable root does not answer, every step chosen for promotion waits;
    the local tier keeps only the newest ``promote_backlog`` of them beyond its own
    rule, withdrawing the older requests (on the game day, two 503 storms filled a
    node's disk with waiting steps, and every save then failed with ENOSPC). No save
    raises for the superseded steps, and the newest is promoted after the outage."""
    root = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}"
    local = tmp_path / "local"
    _first_run(root, local, proxy)
    proxy.plan = faultproxy.FaultPlan(throttle=1.0)
    options = _tiered(root, local, proxy, durable_wait_s=0.5, promote_policy=None)
    options["local_retention"] = policy.KeepLast(1)
    with jaxckpt.CheckpointManager(root, **options) as mgr:
        durable, nearest = mgr._tiers[-1], mgr._tiers[0].protocol
        assert durable.deferred
        mgr.restore()
        for step in range(50, 110, 10):  # each requested; the root does not answer
            mgr.save(step, _state(step))
            mgr.wait()
            mgr.wait_for_deletions()
        assert sorted(read_requests(nearest)) == [90, 100]  # promote_backlog=2
        assert sorted(nearest.committed()) == [90, 100]  # KeepLast(1) and the backlog
        proxy.plan = faultproxy.NO_FAULTS
        wait_until(lambda: durable.learned() is not None, what="the epoch taken after the storm")
        mgr.save(110, _state(110))  # every host adopts the epoch: the requests are stamped
        assert mgr.wait_durable(110) == 110
        mgr.save(120, _state(120))  # a lost step would raise here: none is
        mgr.wait()
    with jaxckpt.CheckpointManager(root, read_only=True) as r:
        assert not {50, 60, 70, 80} & set(r.steps())
        np.testing.assert_array_equal(r.restore(110)["w"], _state(110)["w"])
    with pytest.raises(ValueError, match="promote_backlog"):
        jaxckpt.CheckpointOptions(promote_backlog=0)


def test_local_retention_goes_on_while_a_joined_durable_root_does_not_answer(
    proxy: faultproxy.FaultProxy, s3_server: servers.Server, tmp_path: Path
) -> None:
    """A storm after the job joined its durable root: local retention reads nothing
    there (neither which requested steps are durable nor, past its last reading, the
    health marks), so it keeps deleting (it stopped, and on the game day a storm at the
    end of a run filled 50 of a node's 64 MiB with every step saved in it)."""
    root = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}"
    local = tmp_path / "local"
    _first_run(root, local, proxy)
    options = _tiered(root, local, proxy, promote_policy=policy.EveryNSteps(20))
    options["local_retention"] = policy.KeepLast(1)
    options["storage_options"] = {"max_retries": 1, "initial_delay_s": 0.01, "max_delay_s": 0.02}
    with jaxckpt.CheckpointManager(root, **options) as mgr:
        nearest = mgr._tiers[0].protocol
        mgr.restore()
        assert not mgr._tiers[-1].deferred  # joined before the storm
        proxy.plan = faultproxy.FaultPlan(throttle=1.0)
        for step in range(50, 200, 10):  # 60, 80, ... requested; none promoted
            mgr.save(step, _state(step))
            mgr.wait()
            mgr.wait_for_deletions()
        assert proxy.snapshot()["throttle"] > 0
        assert sorted(read_requests(nearest)) == [160, 180]  # promote_backlog=2
        assert sorted(nearest.committed()) == [160, 180, 190]  # and KeepLast(1)
        proxy.plan = faultproxy.NO_FAULTS


def test_wait_durable_adopts_an_epoch_taken_after_the_last_save(
    proxy: faultproxy.FaultProxy, s3_server: servers.Server, tmp_path: Path
) -> None:
    """One process whose open went on without the durable root saves a step chosen for
    promotion (requested, unstamped) and then waits for it: the epoch taken once the root
    answers is adopted by the wait itself. Before, only a save adopted it, and
    ``wait_durable`` after a run's last save timed out (twice in CI, whose load made the
    open of ``_first_run`` outlast ``durable_wait_s``)."""
    root = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}"
    local = tmp_path / "local"
    _first_run(root, local, proxy)
    proxy.plan = faultproxy.FaultPlan(throttle=1.0)
    with jaxckpt.CheckpointManager(root, **_tiered(root, local, proxy, durable_wait_s=0.5)) as mgr:
        durable = mgr._tiers[-1]
        assert mgr.restore()["b"][0] == 40  # from the local tier: the root does not answer
        mgr.save(60, _state(60))
        mgr.wait()
        assert read_requests(mgr._tiers[0].protocol)[60].epoch == UNSTAMPED
        proxy.plan = faultproxy.NO_FAULTS
        assert mgr.wait_durable(60, timeout_s=HANG_S) == 60
        assert not durable.deferred
    with jaxckpt.CheckpointManager(root, read_only=True) as r:
        assert r.steps() == [20, 40, 60]


def test_wait_durable_on_several_processes_says_the_epoch_waits_for_a_save() -> None:
    """With several processes ``wait_durable`` cannot adopt a deferred epoch (that is
    collective): its timeout says so, and when it happens."""
    from jaxckpt.lifecycle import _promotion

    error = _promotion._late(60, "s3://b/run", 2.0, None, learned=7)
    assert isinstance(error, jaxckpt.PromotionTimeoutError)
    assert "adopts its epoch 7 at the next save or close" in str(error)
    assert "answered after the open" not in str(_promotion._late(60, "s3://b/r", 2.0, "x", None))


def test_the_open_waits_for_nothing_and_the_first_use_adopts_the_epoch(
    proxy: faultproxy.FaultProxy, s3_server: servers.Server, tmp_path: Path
) -> None:
    """The open goes on while the durable root does not answer (a job compiles its step
    meanwhile); ``latest_step()`` waits for it, within ``durable_wait_s`` of the open,
    and every host adopts its epoch there: no save needed."""
    root = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}"
    local = tmp_path / "local"
    first_epoch = _first_run(root, local, proxy)
    proxy.plan = faultproxy.FaultPlan(throttle=1.0)
    with jaxckpt.CheckpointManager(
        root, **_tiered(root, local, proxy, durable_wait_s=HANG_S)
    ) as mgr:
        durable = mgr._tiers[-1]
        assert durable.deferred and durable.protocol.epoch is None  # the open did not wait
        proxy.plan = faultproxy.NO_FAULTS  # the durable root answers before the deadline
        assert mgr.latest_step() == 40
        assert not durable.deferred and durable.protocol.epoch > first_epoch
        assert mgr.ledger.writer is not None and mgr.ledger.writer.epoch == durable.protocol.epoch
        np.testing.assert_array_equal(mgr.restore()["w"], _state(40)["w"])
        mgr.save(60, _state(60))  # chosen for promotion: stamped (else never promoted)
        assert mgr.wait_durable(60) == 60


def test_with_nothing_local_the_restore_waits_for_the_durable_root(
    proxy: faultproxy.FaultProxy, s3_server: servers.Server, tmp_path: Path
) -> None:
    root = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}"
    _first_run(root, tmp_path / "old-node", proxy)
    proxy.plan = faultproxy.FaultPlan(throttle=1.0)
    options = _tiered(root, tmp_path / "new-node", proxy, durable_wait_s=0.5)
    with jaxckpt.CheckpointManager(root, **options) as mgr:
        assert mgr._tiers[-1].deferred
        storm = threading.Timer(1.0, lambda: setattr(proxy, "plan", faultproxy.NO_FAULTS))
        storm.start()  # ends while the restore waits
        restored = mgr.restore()
        storm.join(HANG_S)
    assert mgr.restored_step == 40
    np.testing.assert_array_equal(restored["w"], _state(40)["w"])
    # No save adopted the epoch: the close did, so the ledger's events (the open, the
    # restore) were written under it, none dropped.
    writer = mgr.ledger.writer
    assert writer is not None and writer.epoch == mgr._tiers[-1].protocol.epoch is not None
    assert writer.dropped == 0
    run = next(r for r in read_ledger(open_storage(root)) if r.epoch == writer.epoch)
    assert run.of("open") and [e["step"] for e in run.of("restore")] == [40]


def test_with_nothing_local_the_restore_reads_the_durable_root_before_its_epoch(
    proxy: faultproxy.FaultProxy, s3_server: servers.Server, tmp_path: Path
) -> None:
    """Reading needs the durable root to answer, not the writer epoch: while every write to
    it is throttled (the join cannot take the epoch), a job on a new node restores the
    newest durable step; the epoch is taken once writes go through again."""
    root = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}"
    first_epoch = _first_run(root, tmp_path / "old-node", proxy)
    proxy.inject("throttle", method="PUT", path_contains="", times=None)
    options = _tiered(root, tmp_path / "new-node", proxy, durable_wait_s=0.5)
    with jaxckpt.CheckpointManager(root, **options) as mgr:
        durable = mgr._tiers[-1]
        assert mgr.latest_step() == 40
        restored = mgr.restore()
        assert mgr.restored_step == 40
        np.testing.assert_array_equal(restored["w"], _state(40)["w"])
        assert durable.deferred and durable.protocol.epoch is None  # still no epoch
        assert proxy.snapshot()["throttle"] > 0
        proxy.clear_rules()
    assert mgr._tiers[-1].protocol.epoch > first_epoch  # adopted at the close


def test_a_new_durable_root_is_not_read_after_its_first_answer(
    proxy: faultproxy.FaultProxy, s3_server: servers.Server, tmp_path: Path
) -> None:
    """The join's first request found no root record: a job with nothing local starts
    fresh at once, without listing the new root (its writes are throttled meanwhile, so
    the join is not done); the epoch is taken once they go through. (No promoter runs
    here: a watching one lists the root too.)"""
    root = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}"
    proxy.inject("throttle", method="PUT", path_contains="", times=None)
    proxy.deny(("GET", "commits/"), ("GET", "epochs/"))  # a read of the steps fails the test
    options = _tiered(root, tmp_path / "node", proxy, durable_wait_s=0.5, promotion="external")
    with jaxckpt.CheckpointManager(root, **options) as mgr:
        assert mgr.latest_step() is None
        with pytest.raises(jaxckpt.errors.StepNotFoundError, match="no committed steps"):
            mgr.restore()
        wait_until(lambda: proxy.snapshot()["throttle"] > 0, what="the join's first PUT")
        assert mgr._tiers[-1].deferred  # its writes are still throttled
        assert proxy.snapshot()["deny"] == 0
        proxy.clear_rules()
        mgr.save(20, _state(20))
    assert mgr._tiers[-1].protocol.epoch is not None  # adopted at the close


def test_the_ledger_is_written_as_soon_as_a_deferred_epoch_is_adopted(
    proxy: faultproxy.FaultProxy, s3_server: servers.Server, tmp_path: Path
) -> None:
    """The open went on without the durable root, so its events waited for the epoch: they
    are written once it is adopted, not at the next flush interval (600 s here), so a run
    that dies within its first interval is on the store as one whose open wrote."""
    root = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}"
    proxy.inject("throttle", method="PUT", path_contains="", times=None)
    options = _tiered(root, tmp_path / "node", proxy, durable_wait_s=0.5, ledger_flush_s=600)
    with jaxckpt.CheckpointManager(root, **options) as mgr:
        assert mgr._tiers[-1].deferred
        proxy.clear_rules()
        steps = iter(range(1, 10**6))

        def adopted() -> bool:
            step = next(steps)
            mgr.save(step, _state(step), force=True)
            return not mgr._tiers[-1].deferred

        wait_until(adopted, what="the durable epoch adopted at a save")
        storage = open_storage(root)
        wait_until(lambda: bool(storage.list("ledger/")), what="the ledger", timeout_s=30)
        (run,) = read_ledger(storage)
        assert run.epoch == mgr._tiers[-1].protocol.epoch and run.of("open")


def test_a_promoter_leaves_an_unstamped_request_until_it_is_stamped(tmp_path: Path) -> None:
    local, durable = str(tmp_path / "local"), str(tmp_path / "durable")
    with jaxckpt.CheckpointManager(
        durable, local_root=local, promotion="external", promote_policy=policy.EveryNSteps(1)
    ) as mgr:
        mgr.save(5, _state(5))
        epoch = mgr._tiers[-1].protocol.epoch
    own = CommitProtocol(open_storage(local))
    request = read_requests(own)[5]
    request_promotion(own, request.restamped(UNSTAMPED, request.requested))
    promoter = Promoter(own, CommitProtocol(open_storage(durable)))
    assert promoter.promote_all() == []
    assert 5 in read_requests(own)  # kept for its job to stamp
    request_promotion(own, request.restamped(epoch, request.requested))
    assert [r.outcome for r in promoter.promote_all()] == ["promoted"]


def test_a_save_does_not_wait_for_the_durable_root_to_tell_a_lost_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step whose promotion request went is looked up on the durable root (promoted, or
    lost with its local copy); while that read hangs (an outage), saves go on (the first
    waits ``LOST_WAIT_S``), and the lost step is told by the first save after it answers."""
    from jaxckpt.lifecycle import _promotion

    monkeypatch.setattr(_promotion, "LOST_WAIT_S", 0.2)
    root, local = str(tmp_path / "durable"), str(tmp_path / "local")
    mgr = jaxckpt.CheckpointManager(root, local_root=local, promotion="external")
    mgr.save(1, {"w": np.zeros(4)})
    mgr.wait()
    promotion = mgr._promotion
    withdraw(promotion.local, 1)  # its request went, and it never became durable: lost
    answer, asked = threading.Event(), threading.Event()
    listing = promotion.durable.step_listing

    def hanging(step: int) -> object:
        asked.set()
        answer.wait(HANG_S)
        return listing(step)

    monkeypatch.setattr(promotion.durable, "step_listing", hanging)
    assert mgr.save(2, {"w": np.ones(4)})  # returns while the read hangs
    assert asked.is_set() and not answer.is_set()
    assert mgr.save(3, {"w": np.ones(4)})
    answer.set()
    wait_until(
        lambda: all(c.done() for c in promotion._durable_checks.values()),
        what="the durable lookup of step 1",
    )
    with pytest.raises(jaxckpt.SaveFailedError, match=r"steps \[1\] were committed"):
        mgr.save(4, {"w": np.ones(4)})
    mgr.close()


def test_a_close_inside_a_storm_waits_close_wait_s_for_what_the_run_can_do_without(
    proxy: faultproxy.FaultProxy, s3_server: servers.Server, tmp_path: Path
) -> None:
    """A job that ends inside a storm: ``close()`` commits its save (local), then waits at
    most ``close_wait_s`` in all for the exit record, the ledger's last events and a
    retention pass, each retried against a root that answers 503. It waited for every
    retry: 387 s for a 4-process game-day job whose storm did not end. The saves before
    do not wait for the run's progress record either."""
    root = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}"
    local = tmp_path / "local"
    _first_run(root, local, proxy)
    options = _tiered(root, local, proxy, promotion="external", close_wait_s=1.0)
    options["local_retention"] = policy.KeepLast(1)
    mgr = jaxckpt.CheckpointManager(root, **options)
    mgr.restore()  # a run record: its exit record is due at close
    assert not mgr._tiers[-1].deferred  # joined before the storm
    proxy.plan = faultproxy.FaultPlan(throttle=1.0)
    began = time.monotonic()
    for step in (50, 60):  # 50's progress record is not waited for (it was: HANG_S)
        mgr.save(step, _state(step))
    mgr.close()
    took = time.monotonic() - began
    assert proxy.snapshot()["throttle"] > 0
    assert took < 1.0 + 10.0, took  # the saves commit locally; then 1 s, not HANG_S
    assert mgr._health.failures == 1  # the exit record, not written: counted
    mgr._retention.wait(30)  # the pass close() left: it goes on with the marks last read
    assert sorted(mgr._tiers[0].protocol.committed()) == [60]  # KeepLast(1) went on
    proxy.plan = faultproxy.NO_FAULTS


def test_a_close_in_a_storm_the_ledger_has_met_waits_one_second_not_close_wait_s(
    proxy: faultproxy.FaultProxy,
    s3_server: servers.Server,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once the ledger's writes find the durable root not answering, ``close()`` waits at
    most 1 s (``ledger.OUTAGE_WAIT_S``) for the run's last records, not ``close_wait_s``:
    the game day's job that ended in a storm spent its 5 s there on writes that could not
    succeed."""
    from jaxckpt.ledger import _writer

    monkeypatch.setattr(_writer, "STUCK_S", 0.5)
    root = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}"
    local = tmp_path / "local"
    _first_run(root, local, proxy)
    options = _tiered(root, local, proxy, promotion="external", close_wait_s=30.0)
    options["ledger_flush_s"] = 0.2
    mgr = jaxckpt.CheckpointManager(root, **options)
    mgr.restore()  # a run record: its exit record is due at close
    join = mgr._tiers[-1]._join  # type: ignore[attr-defined]
    if join is not None:  # the join's garbage collection, not in the storm (close waits 10 s)
        join.settled(HANG_S)
    writer = mgr.ledger.writer
    assert writer is not None and writer.answering
    proxy.plan = faultproxy.FaultPlan(throttle=1.0)
    mgr.save(50, _state(50))
    mgr.wait()
    deadline = time.monotonic() + HANG_S
    while writer.answering and time.monotonic() < deadline:  # a flush meets the storm
        time.sleep(0.05)
    assert not writer.answering
    began = time.monotonic()
    mgr.close()
    took = time.monotonic() - began
    assert proxy.snapshot()["throttle"] > 0
    assert took < 1.0 + 5.0, took  # 30 s before
    assert mgr._health.failures == 1  # the exit record, not written: counted
    proxy.plan = faultproxy.NO_FAULTS


@pytest.mark.parametrize("restored", [True, False], ids=["exit-record", "ledger-only"])
def test_a_close_whose_last_ledger_write_meets_a_storm_waits_two_seconds_for_it(
    proxy: faultproxy.FaultProxy, s3_server: servers.Server, tmp_path: Path, restored: bool
) -> None:
    """A storm that began after the ledger's last write: ``close()`` learns of it from its
    own writes, the exit record's first: it waits for it ``STUCK_WRITE_S`` (2 s), then at
    most ``ledger.OUTAGE_WAIT_S`` (1 s) for the rest, not ``close_wait_s`` (the game day's
    job that ended 16 s into a storm waited its 5 s there). Without a restore no exit record
    is due: the ledger's last write is the one retried."""
    from jaxckpt.storage import STUCK_WRITE_S

    root = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}"
    local = tmp_path / "local"
    _first_run(root, local, proxy)
    options = _tiered(root, local, proxy, promotion="external", close_wait_s=30.0)
    mgr = jaxckpt.CheckpointManager(root, **options)
    if restored:
        mgr.restore()
    join = mgr._tiers[-1]._join  # type: ignore[attr-defined]
    if join is not None:  # the join's garbage collection, not in the storm (close waits 10 s)
        join.settled(HANG_S)
    mgr.save(50, _state(50))
    mgr.wait()
    writer = mgr.ledger.writer
    assert writer is not None
    writer.flush()  # what the run did so far is written: the storm meets only the last write
    assert writer.answering and writer.failures == 0
    proxy.plan = faultproxy.FaultPlan(throttle=1.0)
    began = time.monotonic()
    mgr.close()
    took = time.monotonic() - began
    assert proxy.snapshot()["throttle"] > 0
    assert STUCK_WRITE_S <= took < STUCK_WRITE_S + 1.0 + 2.0, took  # 30 s before
    assert mgr._health.failures == int(restored)  # the exit record, not written: counted
    proxy.plan = faultproxy.NO_FAULTS


@pytest.mark.parametrize(
    ("grace_s", "retried_s", "bound_s"),
    [
        (1.0, 0.0, 1.0 + 10.0),  # told soon: the rest of its grace
        (6.0, 7.0, 4.5),  # retried for longer than its grace already: not waited for (6 s)
    ],
)
def test_a_sidecar_told_to_stop_in_a_storm_exits_within_its_grace(
    proxy: faultproxy.FaultProxy,
    s3_server: servers.Server,
    tmp_path: Path,
    grace_s: float,
    retried_s: float,
    bound_s: float,
) -> None:
    """SIGTERM to a ``promote --watch`` sidecar whose promotion is retried against a root
    that answers 503: it exits within ``--stop-grace`` of the pass's start (it waited for
    the retries; the game day's supervisor waited 30 s per sidecar, a pod's grace is 30 s;
    then a job that ended in a storm waited the grace for its sidecars)."""
    root = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}"
    local = tmp_path / "local"
    _first_run(root, local, proxy)
    mgr = jaxckpt.CheckpointManager(root, **_tiered(root, local, proxy, promotion="external"))
    argv = [sys.executable, "-m", "jaxckpt", "promote", str(local), root, "--watch"]
    sidecar = subprocess.Popen(
        [*argv, "--interval", "0.2", "--stop-grace", str(grace_s)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert sidecar.stdout is not None and "watching" in sidecar.stdout.readline()
        proxy.plan = faultproxy.FaultPlan(throttle=1.0)
        mgr.save(60, _state(60))  # committed locally, requested: the sidecar promotes it
        mgr.wait()
        wait_until(lambda: proxy.snapshot()["throttle"] >= 5, what="the sidecar's retries")
        time.sleep(retried_s)
        sidecar.send_signal(signal.SIGTERM)
        began = time.monotonic()
        out, err = sidecar.communicate(timeout=HANG_S)
    finally:
        sidecar.kill()
    assert time.monotonic() - began < bound_s, err[-3000:]
    assert sidecar.returncode == 0, err[-3000:]
    assert "abandoned" in out and "stopped after" in out
    assert 60 in read_requests(CommitProtocol(open_storage(str(local))))  # the next one's
    proxy.plan = faultproxy.NO_FAULTS
    mgr.close()
