"""A restore without a target gives back the saved structure: every container, empty ones
included, and every list and tuple position (the tree record's ``structure``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from rootpaths import step_dir

import jaxckpt
from jaxckpt.commit import CommitProtocol
from jaxckpt.records import FileDigest, dumps
from jaxckpt.storage import open_storage


def _same(a: Any, b: Any) -> None:
    """Equal, container types and positions included (arrays by their bytes)."""
    assert type(a) is type(b), (a, b)
    if isinstance(a, dict):
        assert a.keys() == b.keys()  # (in jax's sorted order: the flatten order)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    else:
        assert a == b


def _restored(root: str, state: Any, layout: str = "packed") -> Any:
    with jaxckpt.CheckpointManager(root, layout=layout) as mgr:
        mgr.save(1, state)
    with jaxckpt.CheckpointManager(root) as mgr:
        return mgr.restore(1)


@pytest.mark.parametrize("layout", ["packed", "plain"])
def test_empty_containers_and_positions_come_back_exactly(tmp_path, layout):
    w = np.arange(6, dtype=np.float32)
    state = {"x": [{}, w], "e": {}}
    _same(_restored(str(tmp_path / "root"), state, layout), state)


def test_empty_tuples_lists_and_none_leaves_keep_their_places(tmp_path):
    w = np.ones(3, np.int8)
    state = {
        "seq": [None, (), w, [], (w, None), {"k": []}],
        "t": (1, (), "s"),
        "n": None,
        "ints": {7: [2.5, True], 1: {}},
    }
    _same(_restored(str(tmp_path / "root"), state), state)


class _Pair(NamedTuple):
    a: Any
    b: Any


def test_named_tuples_and_optax_states_keep_their_positions(tmp_path):
    params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    opt_state = tx.init(params)
    assert isinstance(opt_state[0], optax.EmptyState)  # the slot that used to vanish
    back = _restored(str(tmp_path / "root"), {"opt": opt_state, "p": _Pair(np.ones(2), ())})
    opt = back["opt"]
    assert isinstance(opt, tuple) and len(opt) == 2
    assert opt[0] == {}  # EmptyState: an empty container in its place
    adam = opt[1]
    assert isinstance(adam, tuple) and len(adam) == len(opt_state[1])
    assert sorted(adam[0]) == ["count", "mu", "nu"]
    assert np.asarray(adam[0]["mu"]["w"]).shape == (2, 3)
    assert adam[1] == {}  # adam's trailing EmptyState
    assert list(back["p"]) == ["a", "b"] and back["p"]["b"] == ()
    # with the target, the real types come back as ever
    with jaxckpt.CheckpointManager(str(tmp_path / "root")) as mgr:
        typed = mgr.restore(1, target={"opt": opt_state, "p": _Pair(np.ones(2), ())})
    assert isinstance(typed["opt"][0], optax.EmptyState)


def test_a_record_without_structure_restores_as_before(tmp_path):
    """Records written before ``structure`` existed: dicts and lists built from leaf paths."""
    root = str(tmp_path / "root")
    w = np.arange(4, dtype=np.int32)
    with jaxckpt.CheckpointManager(root) as mgr:
        mgr.save(1, {"x": [{}, w], "e": {}, "t": (w, 2)})
    tree_path = Path(step_dir(root, 1, "tree.json"))
    tree = json.loads(tree_path.read_text())
    assert tree["structure"][0] == "dict"
    del tree["structure"]
    tree_path.write_bytes(dumps(tree))
    storage = open_storage(root)
    marker = CommitProtocol(storage).require_marker(1)
    files = dict(marker.files, **{"tree.json": FileDigest.of(tree_path.read_bytes())})
    resealed = dataclasses.replace(marker, files=files)
    (Path(root) / marker.key).write_bytes(resealed.to_bytes())
    with jaxckpt.CheckpointManager(root) as mgr:
        back = mgr.restore(1)
    assert set(back) == {"x", "t"}  # no record of the empty ones
    assert len(back["x"]) == 1 and back["x"][0].tobytes() == w.tobytes()
    assert isinstance(back["t"], list) and back["t"][1] == 2
