"""The pure parts of reading replicated leaves once (``jaxckpt.restoring._readonce``).

The exchange itself needs several processes: ``tests/test_multihost.py`` (g).
"""

from __future__ import annotations

import functools
import itertools
import math

import crc32c
import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxckpt.formats import chunk_key
from jaxckpt.records import ChunkRecord, SavedLeaf
from jaxckpt.restoring._collective import _Meta, _reassemble
from jaxckpt.restoring._crccombine import crc32c_combine
from jaxckpt.restoring._readonce import _stream_records, plan


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=3000), st.lists(st.integers(0, 3000), max_size=4))
def test_crc32c_of_parts_combines_to_the_crc32c_of_the_whole(data: bytes, cuts: list[int]) -> None:
    bounds = [0, *sorted(min(c, len(data)) for c in cuts), len(data)]
    parts = [data[lo:hi] for lo, hi in itertools.pairwise(bounds)]
    crc = functools.reduce(
        lambda acc, part: crc32c_combine(acc, crc32c.crc32c(part), len(part)),
        parts[1:],
        crc32c.crc32c(parts[0]),
    )
    assert crc == crc32c.crc32c(data)


def _leaf(shape: tuple[int, ...], chunk: tuple[int, ...]) -> SavedLeaf:
    return SavedLeaf(
        path=[["k", "w"]], kind="array", name="w", shape=shape, dtype="float32", chunk_shape=chunk
    )


def _records(leaf: SavedLeaf) -> list[ChunkRecord]:
    """One record per chunk, in grid order."""
    grid = [range(d // c) for d, c in zip(leaf.shape, leaf.chunk_shape, strict=True)]
    size = math.prod(leaf.chunk_shape) * 4 + 4
    out = []
    for index in itertools.product(*grid):
        cell = tuple((i * c, (i + 1) * c) for i, c in zip(index, leaf.chunk_shape, strict=True))
        out.append(ChunkRecord(key=chunk_key(cell, leaf.chunk_shape), size=size, crc32c=0))
    return out


def test_chunks_form_a_stream_in_grid_order_only_when_they_tile_the_array() -> None:
    leaf = _leaf((4, 6), (2, 3))
    records = _records(leaf)
    assert [r.key for r in records] == ["c/0/0", "c/0/1", "c/1/0", "c/1/1"]
    assert _stream_records(leaf, records[::-1]) == tuple(records)
    assert _stream_records(leaf, records[1:]) is None  # a missing chunk: the regular path
    short = [ChunkRecord(key=r.key, size=r.size - 4, crc32c=0) for r in records]
    assert _stream_records(leaf, short) is None  # not a plain full chunk
    assert _stream_records(_leaf((5, 6), (2, 3)), records) is None  # edge chunks


@pytest.mark.parametrize(
    ("shape", "chunk"), [((4, 6), (2, 3)), ((8, 3, 4), (2, 3, 2)), ((6,), (6,))]
)
def test_the_jitted_exchange_reorders_the_stream_into_the_array(
    shape: tuple[int, ...], chunk: tuple[int, ...]
) -> None:
    """On one device: the chunks, concatenated in grid order (and padded), give the array."""
    want = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    pieces = []
    for index in itertools.product(*(range(d // c) for d, c in zip(shape, chunk, strict=True))):
        sl = tuple(slice(i * c, (i + 1) * c) for i, c in zip(index, chunk, strict=True))
        pieces.append(want[sl].reshape(-1))
    stream = np.concatenate([*pieces, np.zeros(3, np.float32)])  # padding at the end
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    meta = _Meta(math.prod(shape), shape, chunk, "bfloat16")
    (got,) = _reassemble((meta,), (sharding,))(jax.device_put(stream, sharding))
    assert got.dtype == jax.numpy.bfloat16 and got.sharding == sharding
    np.testing.assert_array_equal(np.asarray(got, np.float32), want)


def test_one_process_plans_no_exchange() -> None:
    leaf = _leaf((1024, 1024), (256, 1024))
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    assert plan([leaf], [sharding], [np.dtype("float32")], {"w": _records(leaf)}, {"w"}) == []
