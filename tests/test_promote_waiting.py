"""A multi-host step waiting for another host's part never holds up the promoter's pass.

The primary's promoter used to wait for the other hosts' parts inside its pass (up to
``parts_timeout_s``), so a host that lost its local tier (its part never comes) held
every newer step back: on a game day the local tiers filled up meanwhile. Now a pass
looks once and goes on; the step fails after ``parts_timeout_s`` counted across passes,
and its request goes once a newer step is durable. Single process: the other host of a
two-host request is simply never there.

Between passes a watching sidecar sends the durable root nothing, and a new request
starts its next pass at once.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from test_promote_races import requested
from triggers import wait_until

import jaxckpt
from jaxckpt.commit import CommitProtocol
from jaxckpt.lifecycle import Promoter
from jaxckpt.records import (
    FAILED,
    MAX_RECEIPTS,
    PARTS_WAITING,
    PROMOTE,
    PROMOTED,
    SUPERSEDED,
    UNSTAMPED,
    PromotionRequest,
    new_attempt,
    read_requests,
    request_promotion,
    withdraw,
    withdraw_durable,
)
from jaxckpt.storage import open_storage


def as_two_hosts(local: CommitProtocol, step: int) -> PromotionRequest:
    """Rewrites ``step``'s request as the primary's of a two-host save (process 1's
    part never comes)."""
    request = read_requests(local)[step]
    two = dataclasses.replace(
        request, attempt=new_attempt(request.epoch), process=0, processes=2, primary=0
    )
    request_promotion(local, two)
    return two


def outcomes(results: list) -> dict[int, str]:
    return {r.step: r.outcome for r in results}


def test_a_step_waiting_for_parts_does_not_hold_up_an_older_one(tmp_path: Path) -> None:
    local, durable = requested(tmp_path / "local", str(tmp_path / "durable"), [10, 20])
    as_two_hosts(local, 20)
    promoter = Promoter(local, durable, parts_timeout_s=600.0)
    assert outcomes(promoter.promote_once()) == {20: PARTS_WAITING, 10: PROMOTED}
    assert sorted(durable.committed()) == [10]
    assert sorted(read_requests(local)) == [20]  # it waits on
    promoter.parts_timeout_s = 0.0  # the bound is counted from the pass that began it
    assert outcomes(promoter.promote_once()) == {20: FAILED}  # nothing newer is durable
    assert sorted(read_requests(local)) == [20]  # retried after a back-off


def test_a_step_whose_parts_never_come_goes_once_a_newer_one_is_durable(
    tmp_path: Path,
) -> None:
    local, durable = requested(tmp_path / "local", str(tmp_path / "durable"), [10, 20])
    as_two_hosts(local, 10)
    promoter = Promoter(local, durable, parts_timeout_s=0.0)
    assert outcomes(promoter.promote_once()) == {20: PROMOTED, 10: SUPERSEDED}
    assert read_requests(local) == {}  # step 10 is no longer pinned in the local tier
    assert sorted(durable.committed()) == [20]


def test_another_hosts_uploaded_part_is_withdrawn_once_a_newer_step_is_durable(
    tmp_path: Path,
) -> None:
    local, durable = requested(tmp_path / "local", str(tmp_path / "durable"), [10, 20])
    request = read_requests(local)[10]
    other = dataclasses.replace(
        request, attempt=new_attempt(request.epoch), process=0, processes=2, primary=1
    )
    request_promotion(local, other)  # this host is process 0; process 1 commits
    promoter = Promoter(local, durable)
    assert outcomes(promoter.promote_once()) == {20: PROMOTED, 10: SUPERSEDED}
    assert read_requests(local) == {}
    assert sorted(durable.committed()) == [20]
    parts = durable.storage.list("data/")
    assert any(k.endswith(f"10.{other.attempt}/manifest/0.json") for k in parts), parts


def restarted(local: CommitProtocol, request: PromotionRequest) -> PromotionRequest:
    """``request`` as a restarted job's open leaves it: restamped into the next epoch
    (a new attempt id, the same on every host)."""
    again = request.restamped(request.epoch + 1, time.time())
    request_promotion(local, again)
    return again


def test_the_parts_bound_counts_from_the_first_attempt_across_restarts(tmp_path: Path) -> None:
    """A job restarted more often than ``parts_timeout_s`` restamps its requests each
    time: a step whose parts never come still fails (it used to wait for ever, pinned
    in the local tier and its part uploaded again under each new attempt)."""
    local, durable = requested(tmp_path / "local", str(tmp_path / "durable"), [10])
    first = as_two_hosts(local, 10)
    promoter = Promoter(local, durable, parts_timeout_s=600.0)
    assert outcomes(promoter.promote_once()) == {10: PARTS_WAITING}
    time.sleep(0.2)
    restarted(local, first)
    promoter.parts_timeout_s = 0.1  # passed since the first attempt, not since the second
    assert outcomes(promoter.promote_once()) == {10: FAILED}


def test_a_superseded_step_restamped_since_it_was_begun_goes_without_another_upload(
    tmp_path: Path,
) -> None:
    """The other hosts uploaded their parts into the old attempt and withdrew their
    requests (superseded): the primary's part goes nowhere new, and the step is unpinned."""
    local, durable = requested(tmp_path / "local", str(tmp_path / "durable"), [10, 20])
    first = as_two_hosts(local, 10)
    promoter = Promoter(local, durable, parts_timeout_s=600.0)
    assert outcomes(promoter.promote_once()) == {20: PROMOTED, 10: PARTS_WAITING}
    again = restarted(local, first)
    assert outcomes(promoter.promote_once()) == {10: SUPERSEDED}
    assert read_requests(local) == {}
    parts = durable.storage.list("data/")
    assert any(first.attempt in k for k in parts), parts  # begun once
    assert not any(again.attempt in k for k in parts), parts  # and never again


def test_an_idle_promoter_sends_the_durable_root_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A watching sidecar's pass with no request to serve (all promoted, or an unstamped
    one of a job without a durable epoch yet) lists nothing there: it used to list
    ``commits/`` and ``writers/`` at every pass (every second, on every node)."""
    local, durable = requested(tmp_path / "local", str(tmp_path / "durable"), [10])
    request = read_requests(local)[10]
    promoter = Promoter(local, durable)
    listed: list[str] = []
    inner = durable.storage.list

    def counted(prefix: str) -> list[str]:
        listed.append(prefix)
        return inner(prefix)

    monkeypatch.setattr(durable.storage, "list", counted)
    assert outcomes(promoter.promote_once()) == {10: PROMOTED}
    assert listed  # a pass with a request reads the durable root
    listed.clear()
    assert promoter.promote_once() == []  # nothing requested
    request_promotion(local, request.restamped(UNSTAMPED, request.requested))
    assert promoter.promote_once() == []  # its job has no durable epoch yet
    assert listed == []


def test_a_watching_sidecar_starts_a_pass_when_a_request_appears(tmp_path: Path) -> None:
    """Between passes (``interval_s`` apart) a sidecar lists its local requests every
    ``REQUEST_POLL_S``: a step requested meanwhile is promoted at once, not an interval
    later (the step's exposure to a lost node)."""
    local, durable = requested(tmp_path / "local", str(tmp_path / "durable"), [10])
    promoter = Promoter(local, durable)
    stop = threading.Event()
    watcher = threading.Thread(target=promoter.watch, args=(stop,), kwargs={"interval_s": 600})
    watcher.start()
    try:
        wait_until(lambda: sorted(durable.committed()) == [10], what="step 10", timeout_s=30)
        with jaxckpt.CheckpointManager(
            str(tmp_path / "durable"), local_root=str(tmp_path / "local"), promotion="external"
        ) as mgr:
            mgr.save(20, {"w": np.arange(256.0) + 20}, force=True)
        asked = time.monotonic()
        wait_until(lambda: 20 in durable.committed(), what="step 20", timeout_s=30)
        assert time.monotonic() - asked < 10  # the interval is 600 s
    finally:
        stop.set()
        watcher.join(timeout=30)
    assert not watcher.is_alive()


def test_a_trainer_learns_that_its_step_is_durable_from_the_promoters_receipt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The promoter leaves a receipt where it withdraws a durable step's request: the
    trainer's next save learns from it that the step it asked for is durable, and reads
    nothing on the durable root (it used to list it there, waiting up to
    ``LOST_WAIT_S`` in the save's blocking phase: 18 ms a promoted step on the game day)."""
    durable_root, local_root = str(tmp_path / "durable"), str(tmp_path / "local")
    mgr = jaxckpt.CheckpointManager(durable_root, local_root=local_root, promotion="external")
    mgr.save(10, {"w": np.arange(4.0)}, force=True)
    mgr.wait()
    local = CommitProtocol(open_storage(local_root))
    promoter = Promoter(local, CommitProtocol(open_storage(durable_root)))
    assert outcomes(promoter.promote_once()) == {10: PROMOTED}
    assert local.storage.list(PROMOTE) == [f"{PROMOTE}000000000010.done"]
    looked: list[int] = []
    monkeypatch.setattr(mgr._promotion, "_durable_has", lambda step: looked.append(step))
    assert mgr.save(20, {"w": np.arange(4.0)}, force=True)
    mgr.wait()
    assert looked == []
    assert mgr._promotion._awaiting == {20}  # step 10: known durable
    mgr.close()


def test_a_receipt_that_comes_while_a_durable_lookup_is_pending_ends_the_lookup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request withdrawn without a receipt starts a durable lookup; when the receipt
    comes before the lookup answers (a slow durable root), the step is known durable
    and its pending lookup is dropped, not kept for a step no save asks about again."""
    durable_root, local_root = str(tmp_path / "durable"), str(tmp_path / "local")
    mgr = jaxckpt.CheckpointManager(durable_root, local_root=local_root, promotion="external")
    mgr.save(10, {"w": np.arange(4.0)}, force=True)
    mgr.wait()
    local = CommitProtocol(open_storage(local_root))
    answer = threading.Event()
    monkeypatch.setattr(mgr._promotion, "_durable_has", lambda step: answer.wait(30))
    monkeypatch.setattr("jaxckpt.lifecycle._promotion.LOST_WAIT_S", 0.05)
    withdraw(local, 10)  # the request went, no receipt (yet): looked up, unanswered
    assert mgr._promotion.lost_error() is None
    assert set(mgr._promotion._durable_checks) == {10}
    withdraw_durable(local, 10)  # then the receipt
    assert mgr._promotion.lost_error() is None
    assert mgr._promotion._durable_checks == {}
    assert mgr._promotion._awaiting == set()
    answer.set()
    mgr.close()


def test_a_promoter_keeps_only_the_newest_receipts(tmp_path: Path) -> None:
    """Receipts are bounded, and a new request of a step drops its older receipt (an
    earlier run's): a receipt answers only a request written before it."""
    local, durable = requested(tmp_path / "local", str(tmp_path / "durable"), [10])
    request = read_requests(local)[10]
    withdraw_durable(local, 10)
    request_promotion(local, request)
    assert sorted(local.storage.list(PROMOTE)) == [f"{PROMOTE}000000000010.json"]
    for step in range(11, 23):  # receipts no trainer came to read
        withdraw_durable(local, step)
    assert outcomes(Promoter(local, durable).promote_once()) == {10: PROMOTED}
    assert sorted(local.storage.list(PROMOTE)) == [  # pruned as its pass listed them
        f"{PROMOTE}{s:012d}.done" for s in [10, *range(23 - MAX_RECEIPTS, 23)]
    ]
