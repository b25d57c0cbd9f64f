"""Reads racing a delete: a step deleted mid-read is "deleted", and cp copies the rest.

Each race is made deterministic by running the deleting process (``jaxckpt
prune``, a separate process) at the worst moment: after the reader listed the
step, before it read it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import jaxckpt
from jaxckpt import cli
from jaxckpt.commit import CommitProtocol
from jaxckpt.storage import open_storage
from jaxckpt.tools import _copy


def _prune(root: str, keep_last: int) -> None:
    """``jaxckpt prune`` in its own process, as a retention job would run it."""
    subprocess.run(
        [sys.executable, "-m", "jaxckpt", "prune", root, "--keep-last", str(keep_last)],
        check=True,
        capture_output=True,
        timeout=120,
        env=os.environ.copy(),
    )


def _saved(root: str, steps=(1, 2, 3)) -> None:
    with jaxckpt.CheckpointManager(root) as mgr:
        for s in steps:
            mgr.save(s, {"w": np.full((8, 8), s, np.float32)})


@pytest.mark.parametrize("via", ["restore", "require_marker"])
def test_a_step_deleted_after_the_listing_is_deleted_not_damaged(
    storage_root, monkeypatch, caplog, via
):
    _saved(storage_root)
    reader = jaxckpt.CheckpointManager(storage_root, read_only=True)
    listing = CommitProtocol.visible_refs
    pruned = []

    def listed_then_pruned(self, *args, **kwargs):
        refs = listing(self, *args, **kwargs)
        if not pruned:
            pruned.append(True)
            _prune(storage_root, keep_last=1)  # deletes 1 and 2 after this listing
        return refs

    monkeypatch.setattr(CommitProtocol, "visible_refs", listed_then_pruned)
    if via == "require_marker":  # as `jaxckpt inspect`, verify and open_step use it
        with pytest.raises(jaxckpt.StepNotFoundError, match=r"step 1 .* was deleted"):
            CommitProtocol(open_storage(storage_root)).require_marker(1)
    else:
        with pytest.raises(jaxckpt.StepNotFoundError, match="deleted"):
            reader.restore(1)
    assert pruned
    assert "damaged" not in caplog.text


def test_cp_skips_a_step_deleted_mid_copy_and_copies_the_rest(
    storage_root, tmp_path, monkeypatch, capsys
):
    _saved(storage_root)
    dst = str(tmp_path / "copy")
    copy_objects = _copy._copy_objects
    pruned = []

    def pruned_mid_copy(src, dst_storage, keys, chunks, rename, packed=None):
        if not pruned and rename[0].step == 2:  # the first objects of step 2
            pruned.append(True)
            _prune(storage_root, keep_last=1)  # retention deletes 1 and 2 now
        return copy_objects(src, dst_storage, keys, chunks, rename, packed)

    monkeypatch.setattr(_copy, "_copy_objects", pruned_mid_copy)
    assert cli.main(["cp", storage_root, dst]) == 0
    out = capsys.readouterr().out
    assert pruned
    assert "step 2: deleted from " in out and " during the copy, skipped" in out
    assert "2 committed steps (1 deleted from the source meanwhile)" in out
    copied = jaxckpt.CheckpointManager(dst, read_only=True)
    assert copied.steps() == [1, 3]
    np.testing.assert_array_equal(copied.restore(3)["w"], np.full((8, 8), 3, np.float32))
    assert open_storage(dst).list("pending/") == []  # no partial copy left behind
