"""Chunk shapes: few chunks whatever an axis's length, a partial edge chunk where one writer
holds it, and the stored steps readable by jaxckpt's readers and by zarr-python."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
from rootpaths import step_dir

import jaxckpt
from jaxckpt import zarr_compat
from jaxckpt.commit import CommitProtocol
from jaxckpt.records import chunk_shape_for
from jaxckpt.storage import open_storage


def _count(chunk: tuple[int, ...], shard: tuple[int, ...]) -> int:
    return math.prod(-(-s // c) for s, c in zip(shard, chunk, strict=True))


@pytest.mark.parametrize(
    ("shard", "shape", "target", "chunk"),
    [
        ((8209, 2048), (8209, 2048), 64 << 20, (4105, 2048)),  # the leaf: 2 chunks
        ((8209, 2048), (16418, 2048), 64 << 20, (8209, 1024)),  # rows sharded: split columns
        ((1024, 1024), (1024, 1024), 1 << 20, (256, 1024)),  # unchanged where divisors do
        ((1024, 1024), (4096, 1024), 1 << 20, (256, 1024)),
        ((101, 7), (101, 7), 256, (9, 7)),  # prime rows, whole: 12 chunks, not 101
        ((2 * 4099,), (2 * 4099,), 4099, (911,)),  # 2 x prime: 9 chunks, not 8198
        ((7, 3), (7, 3), 1 << 20, (7, 3)),
        ((3 << 23,), (3 << 23,), (16 << 20) - 4, (3 << 20,)),  # 8 chunks by halving: kept
        ((0, 3), (0, 3), 1 << 20, (1, 3)),
        ((), (), 16, ()),
    ],
)
def test_chunk_shapes(shard, shape, target, chunk):
    assert chunk_shape_for(shard, 4, target, shape) == chunk


def test_chunks_fit_tile_their_shard_and_are_few():
    rng = random.Random(0)
    for _ in range(400):
        rank = rng.randint(1, 3)
        shard = tuple(rng.choice([1, 2, 3, 7, 64, 97, 128, 1000, 8209]) for _ in range(rank))
        splits = tuple(rng.choice([1, 1, 2, 4]) for _ in range(rank))
        shape = tuple(s * n for s, n in zip(shard, splits, strict=True))
        itemsize, target = rng.choice([1, 2, 4]), rng.choice([256, 4096, 1 << 16])
        chunk = chunk_shape_for(shard, itemsize, target, shape)
        row = math.prod(shard[1:]) * itemsize
        assert math.prod(chunk) * itemsize <= target or math.prod(chunk) == 1 or row > target
        for c, s, d in zip(chunk, shard, shape, strict=True):
            assert 1 <= c <= max(1, s)
            if s != d:  # split across shards: every chunk lies in one shard
                assert s % c == 0, (shard, shape, chunk)
        if all(s == d for s, d in zip(shard, shape, strict=True)) and row <= target:
            ideal = -(-math.prod(shard) * itemsize // target)
            assert _count(chunk, shard) <= 2 * (2 * ideal + 1), (shard, chunk, target)


@pytest.mark.parametrize("layout", ["plain", "packed"])
def test_a_prime_axis_is_stored_in_a_few_chunks_and_reads_back_everywhere(tmp_path, layout):
    import zarr

    root = str(tmp_path / "root")
    w = np.random.default_rng(0).standard_normal((101, 7)).astype(np.float32)
    with jaxckpt.CheckpointManager(root, chunk_bytes=256, layout=layout) as mgr:
        mgr.save(1, {"w": w, "b": np.arange(5, dtype=np.int16)})
    marker = CommitProtocol(open_storage(root)).require_marker(1)
    tree = json.loads(Path(step_dir(root, 1, "tree.json")).read_text())
    leaf = next(x for x in tree["leaves"] if x["name"] == "w")
    assert leaf["chunk_shape"] == [9, 7]
    part = json.loads(Path(root, marker.location.key("manifest/0.json")).read_text())
    chunks = part["arrays"]["w"]
    assert len(chunks) == 12  # ceil(101 / 9); 101 one-row chunks before
    assert {c[1] for c in chunks} == {9 * 7 * 4 + 4}  # the edge chunk is stored whole, padded
    assert marker.nbytes == sum(c[1] for cs in part["arrays"].values() for c in cs)

    with jaxckpt.CheckpointManager(root) as mgr:
        back = mgr.restore(1)
        assert back["w"].tobytes() == w.tobytes()
        target = {"w": np.zeros((101, 7), np.float32), "b": np.zeros(5, np.int16)}
        assert mgr.restore(1, target=target)["w"].tobytes() == w.tobytes()
    step = jaxckpt.open_step(root, 1)
    assert step["w"][95:101, 2:5].tobytes() == w[95:101, 2:5].tobytes()  # the edge chunk
    assert step["w"][8:10].tobytes() == w[8:10].tobytes()  # across a chunk boundary

    group = (
        zarr.open_group(step_dir(root, 1), mode="r")["arrays"]
        if layout == "plain"
        else zarr_compat.open_group(root, 1)
    )
    assert np.asarray(group["w"][...]).tobytes() == w.tobytes()
    assert group["w"].chunks == (9, 7)


def test_verify_checks_a_step_with_a_partial_edge_chunk(tmp_path, capsys):
    from jaxckpt import cli

    root = str(tmp_path / "root")
    with jaxckpt.CheckpointManager(root, chunk_bytes=256) as mgr:
        mgr.save(1, {"w": np.ones((101, 7), np.float32)})
    assert cli.main(["verify", root, "1"]) == 0
    assert "12 chunks" in capsys.readouterr().out


class _HalfRows:
    """A sharding that splits axis 0 in two (what ``describe_state`` asks of one)."""

    device_set = frozenset({0, 1})

    def shard_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (shape[0] // 2, *shape[1:])


class _Sharded(np.ndarray):
    sharding = _HalfRows()


def test_a_prime_axis_split_across_devices_with_nothing_else_to_split_is_refused():
    from jaxckpt.records import describe_state

    rows = np.zeros((2 * 8209, 2048), np.float32).view(_Sharded)
    (leaf,), _ = describe_state({"w": rows}, chunk_bytes=64 << 20)
    assert leaf.chunk_shape == (8209, 1024)  # the columns split instead: 2 chunks per shard
    flat = np.zeros(2 * 300_007, np.float32).view(_Sharded)  # a prime shard: 1-element chunks
    with pytest.raises(jaxckpt.UnsupportedLeafError, match=r"leaf \['w'\].* 300,007 chunks"):
        describe_state({"w": flat}, chunk_bytes=1 << 20)
