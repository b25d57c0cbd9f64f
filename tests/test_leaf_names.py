"""Leaf names become storage names that are valid and distinct on every backend."""

from __future__ import annotations

import numpy as np
from trees import assert_tree_bitexact

import jaxckpt
from jaxckpt.commit import CommitProtocol
from jaxckpt.records import MAX_NAME_CHARS, array_names
from jaxckpt.restoring import load_step
from jaxckpt.storage import open_storage


def _state() -> dict:
    long = "k" * 300
    return {
        "zarr.json": np.arange(6, dtype=np.int32),  # the arrays group's own metadata name
        "zarr_json": np.arange(3, dtype=np.int8),
        long: np.ones((2, 3), np.float32),
        long + "x": np.zeros(4, np.float32),  # same first 300 characters
        "params": {"dense": {"kernel": np.eye(3, dtype=np.float32)}},
    }


def test_awkward_keys_save_and_restore_on_every_backend(storage_root):
    state = _state()
    with jaxckpt.CheckpointManager(storage_root) as mgr:
        assert mgr.save(1, state)
        mgr.wait()
        assert mgr.steps() == [1]
    restored = jaxckpt.CheckpointManager(storage_root, read_only=True).restore(1, target=state)
    assert_tree_bitexact(restored, state)

    protocol = CommitProtocol(open_storage(storage_root))
    names = [leaf.name for leaf in load_step(protocol, protocol.require_marker(1)).leaves]
    assert len(set(names)) == len(names)
    assert all(n is not None and 0 < len(n) <= MAX_NAME_CHARS for n in names)
    assert "params.dense.kernel" in names and "zarr_json" in names  # fine names: unchanged


def test_names_that_were_fine_keep_their_spelling():
    paths = [[["d", "params"], ["d", "w"]], [["d", "a b"]], [["d", "a_b"]], [["s", 0]]]
    assert array_names(paths) == ["params.w", "a_b", "a_b~2", "0"]


def test_reserved_and_long_names_are_escaped_deterministically():
    long = [["d", "y" * 500]]
    names = array_names([[["d", "zarr.json"]], long, [["d", "y" * 500 + "z"]]])
    assert names[0] != "zarr.json" and names[0].startswith("zarr.json")
    assert all(len(n) <= MAX_NAME_CHARS for n in names) and len(set(names)) == 3
    assert array_names([long]) == array_names([long])  # same tree, same names
