"""The promoter's pass survives benign delete races: what vanished is skipped, the rest promoted.

A local step deleted (as retention does) while the promoter copies it, and a
durable step deleted by another process while the promoter's durable
retention deletes it: each is one log line, and every other requested step
is promoted in the same pass. Local and loopback S3 durable roots.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import jaxckpt
from jaxckpt import policy, tools
from jaxckpt.commit import CommitProtocol
from jaxckpt.lifecycle import Promoter
from jaxckpt.lifecycle import _promoter as _promote
from jaxckpt.records import GONE, PROMOTED, read_requests, withdraw
from jaxckpt.storage import open_storage


def requested(local: Path, root: str, steps: list[int]) -> tuple[CommitProtocol, CommitProtocol]:
    """``steps`` committed on ``local`` and requested, none promoted (an external promoter)."""
    with jaxckpt.CheckpointManager(root, local_root=str(local), promotion="external") as mgr:
        for s in steps:
            mgr.save(s, {"w": np.arange(256.0) + s}, force=True)
    local_p, durable_p = (
        CommitProtocol(open_storage(str(local))),
        CommitProtocol(open_storage(root)),
    )
    assert sorted(read_requests(local_p)) == steps
    return local_p, durable_p


def test_a_local_step_deleted_mid_copy_is_skipped_and_the_rest_promoted(
    storage_root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    local = tmp_path / "nvme"
    local_p, durable_p = requested(local, storage_root, [1, 2, 3])
    copy = tools.copy_step

    def racing(src: CommitProtocol, dst: CommitProtocol, marker: Any, **kw: Any) -> int:
        if marker.step == 2:  # retention deletes it while the copy starts
            CommitProtocol(open_storage(str(local))).delete(2)
        return copy(src, dst, marker, **kw)

    monkeypatch.setattr(tools, "copy_step", racing)  # the face: what the promoter calls
    caplog.set_level(logging.INFO, logger="jaxckpt")
    results = Promoter(local_p, durable_p).promote_once()
    outcomes = {r.step: r.outcome for r in results}
    assert outcomes == {3: PROMOTED, 2: GONE, 1: PROMOTED}, results
    assert sorted(durable_p.committed()) == [1, 3]
    assert read_requests(local_p) == {}
    about_2 = [r for r in caplog.records if "step 2" in r.getMessage()]
    assert len(about_2) == 1 and about_2[0].levelno < logging.ERROR, about_2


def test_a_durable_step_deleted_meanwhile_does_not_stop_durable_retention(
    storage_root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = tmp_path / "nvme"
    local_p, durable_p = requested(local, storage_root, [1, 2, 3])
    delete = CommitProtocol.delete

    def racing(self: CommitProtocol, step: int, **kw: Any) -> None:
        delete(CommitProtocol(self.storage), step)  # another pruner got there first
        delete(self, step, **kw)

    monkeypatch.setattr(CommitProtocol, "delete", racing)
    results = Promoter(local_p, durable_p, retention=policy.KeepLast(k=1)).promote_once()
    assert [r.outcome for r in results] == [PROMOTED] * 3, results
    assert sorted(durable_p.committed()) == [3]  # promoted newest first: 3, 2, then 1
    assert _promote.read_requests(local_p) == {}


def test_a_step_withdrawn_behind_a_newer_durable_step_is_not_lost(tmp_path: Path) -> None:
    """After an outage the promoters' backlog goes newest first, and another host's
    promoter withdraws the request of a step older than a durable one (superseded):
    the trainer's next save does not call that step lost (it did: SaveFailedError
    stopped the game day's job after a storm)."""
    local, root = tmp_path / "local", str(tmp_path / "durable")
    state = {"w": np.arange(256.0)}
    with jaxckpt.CheckpointManager(
        root, local_root=str(local), promotion="external", promote_policy=policy.EveryNSteps(10)
    ) as mgr:
        mgr.save(10, state)
        mgr.save(20, state)
        mgr.wait()
        own, durable = CommitProtocol(open_storage(str(local))), CommitProtocol(open_storage(root))
        withdraw(own, 10)  # superseded: 20 is promoted, 10 never
        assert [r.outcome for r in Promoter(own, durable).promote_all()] == [PROMOTED]
        assert sorted(durable.visible_refs()) == [20]
        mgr.save(30, state)  # the lookup of 10 answers "a newer step is durable"
        mgr.save(40, state)
        mgr.wait()
    with jaxckpt.CheckpointManager(
        str(tmp_path / "other"),
        local_root=str(tmp_path / "local2"),
        promotion="external",
        promote_policy=policy.EveryNSteps(10),
    ) as mgr:
        mgr.save(10, state)
        mgr.wait()
        withdraw(CommitProtocol(open_storage(str(tmp_path / "local2"))), 10)
        with pytest.raises(jaxckpt.SaveFailedError, match=r"steps \[10\]"):
            mgr.save(20, state)  # gone with nothing durable at or past it: lost
