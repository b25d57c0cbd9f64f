"""Metadata cost of the per-step operations does not grow with the number of steps.

Counted, not timed: which prefixes ``restore()`` of the newest step, a save
until committed and ``latest_step()`` list, on roots with many committed steps
(markers copied from a real one, as ``scripts/benchkit/listing.py`` builds them),
on a local directory and a loopback S3 server.
"""

from __future__ import annotations

import contextlib
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

import jaxckpt
from jaxckpt.commit import CommitProtocol
from jaxckpt.records import COMMITS, latest_hint_key
from jaxckpt.storage import Storage, open_storage


def fill(root: str, steps: int) -> None:
    """``steps`` committed steps: 1 and ``steps`` saved, the others' markers copied from 1."""
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(1, {"w": np.arange(64.0)})
    storage = open_storage(root)
    marker = CommitProtocol(storage).require_marker(1)
    for s in range(2, steps):
        copy = type(marker)(**{**marker.__dict__, "step": s})
        storage.write(copy.key, copy.to_bytes())
    storage.write(latest_hint_key(marker.epoch), str(steps - 1).encode())
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(steps, {"w": np.arange(64.0) + steps})


@contextmanager
def listings(storage: Storage) -> Iterator[Counter[str]]:
    """Counts ``storage.list`` calls by prefix while the block runs."""
    counts: Counter[str] = Counter()
    original = storage.list

    def counting(prefix: str) -> list[str]:
        counts[prefix] += 1
        return original(prefix)

    storage.list = counting  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        del storage.list  # type: ignore[misc]


@pytest.fixture(params=["local", "s3"])
def scale_root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "root")
    server = request.getfixturevalue("s3_server")
    return f"s3://{server.bucket}/{uuid.uuid4().hex}"


def test_restore_newest_and_save_list_no_commits(scale_root: str) -> None:
    fill(scale_root, 30)
    with jaxckpt.CheckpointManager(scale_root) as mgr:
        storage = mgr._tiers[0].storage
        with listings(storage) as counts:
            state = mgr.restore()
            assert mgr.restored_step == 30
            np.testing.assert_array_equal(state["w"], np.arange(64.0) + 30)
            assert mgr.latest_step() == 30
        assert counts[COMMITS] == 0, counts
        with listings(storage) as counts:
            assert mgr.save(31, {"w": np.arange(64.0)}, force=True)
            mgr.wait()
            assert mgr.save(32, {"w": np.arange(64.0)}, force=True)
            mgr.wait()
        assert counts[COMMITS] == 0, counts
        assert mgr.latest_step() == 32
        with pytest.raises(jaxckpt.StepAlreadyExistsError):
            mgr.save(32, {"w": np.arange(64.0)}, force=True)  # its own epoch's marker
        with pytest.raises(jaxckpt.StepAlreadyExistsError):
            mgr.save(7, {"w": np.arange(64.0)}, force=True)  # a step it knew at the takeover
    assert jaxckpt.CheckpointManager(scale_root, read_only=True).steps() == list(range(1, 33))


def test_restore_newest_falls_back_through_a_listing(scale_root: str) -> None:
    """The newest marker gone (deleted by hand): restore() lists and restores the next one."""
    with jaxckpt.CheckpointManager(scale_root) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, {"w": np.arange(4.0) + s}, force=True)
    storage = open_storage(scale_root)
    storage.delete(CommitProtocol(storage).require_marker(3).key)
    with jaxckpt.CheckpointManager(scale_root, read_only=True) as mgr:
        np.testing.assert_array_equal(mgr.restore()["w"], np.arange(4.0) + 2)
        assert mgr.restored_step == 2


def test_a_zombie_marker_of_an_unknown_step_does_not_block_a_save(scale_root: str) -> None:
    """A marker an older epoch wrote after the takeover is invisible: the save goes ahead."""
    fill(scale_root, 3)
    old = jaxckpt.CheckpointManager(scale_root)
    new = jaxckpt.CheckpointManager(scale_root)  # fences ``old``
    storage = open_storage(scale_root)
    marker = CommitProtocol(storage).require_marker(3)
    zombie = type(marker)(**{**marker.__dict__, "step": 9, "epoch": old.epoch})
    storage.write(zombie.key, zombie.to_bytes())
    assert 9 not in new.steps()
    assert new.save(9, {"w": np.arange(64.0)}, force=True)
    new.wait()
    assert new.restore(9)["w"].shape == (64,)
    new.close()
    with contextlib.suppress(jaxckpt.CheckpointError):
        old.close()


def test_a_writable_open_lists_commits_once(
    scale_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The epoch records every visible step, so one listing of commits/ is needed: only one."""
    fill(scale_root, 30)
    from jaxckpt.tiers import _open

    counts: Counter[str] = Counter()
    opened = _open.open_storage

    def counted(root: str, **kwargs: object) -> Storage:
        storage = opened(root, **kwargs)  # type: ignore[arg-type]
        original = storage.list

        def counting(prefix: str) -> list[str]:
            counts[prefix] += 1
            return original(prefix)

        storage.list = counting  # type: ignore[method-assign]
        return storage

    monkeypatch.setattr(_open, "open_storage", counted)
    with jaxckpt.CheckpointManager(scale_root) as mgr:
        assert mgr.epoch == 3
        assert counts[COMMITS] == 1, counts


def test_steps_past_twelve_digits_take_the_same_paths(scale_root: str) -> None:
    """Marker names of steps from 10**12 ('w' + 19 digits) go through the layout's helpers."""
    big = 10**12 + 5
    with jaxckpt.CheckpointManager(scale_root) as mgr:
        mgr.save(7, {"w": np.arange(4.0)})
        mgr.save(big, {"w": np.arange(4.0) + 1})
        mgr.wait()
        with pytest.raises(jaxckpt.StepAlreadyExistsError):
            mgr.save(big, {"w": np.arange(4.0)}, force=True)
    with jaxckpt.CheckpointManager(scale_root) as mgr:
        storage = mgr._tiers[0].storage
        with listings(storage) as counts:
            np.testing.assert_array_equal(mgr.restore()["w"], np.arange(4.0) + 1)
            assert mgr.restored_step == big and mgr.latest_step() == big
            mgr.save(big + 1, {"w": np.arange(4.0)}, force=True)
            mgr.wait()
        assert counts[COMMITS] == 0, counts
        with pytest.raises(jaxckpt.StepAlreadyExistsError):
            mgr.save(big, {"w": np.arange(4.0)}, force=True)  # known at the takeover
        assert mgr.steps() == [7, big, big + 1]
