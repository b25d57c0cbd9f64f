"""Fast reads of plain and packed jaxckpt arrays, straight from their chunk bytes.

An array written by jaxckpt stores each chunk as ``raw little-endian bytes ||
crc32c(raw)`` (zarr codecs ``bytes`` + ``crc32c``). Reading those objects
with :meth:`Storage.read_buffer` on a thread pool and checking them against
the manifest (hardware CRC32C over the buffer, no copy) is several times
faster than TensorStore's zarr decode path, and names the damaged chunk
directly (after reading it twice more, see ``_reread``: a byte flipped in
transit is not damage). A packed step's chunks are ranged reads of their pack objects
(:meth:`Storage.read_range`): adjacent chunks that the read needs are fetched
together (one request per run of adjacent chunks: about the restore's packed bytes
over ``workers``, so that many requests are in flight, between ``MIN_SPAN_BYTES`` and
``MAX_SPAN_BYTES``), each still checked
against its own record. Arrays with any other codec chain (e.g. ``jaxckpt cp --compress
zstd`` archives) are read through TensorStore instead.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Union

import numpy as np
import tensorstore as ts

from jaxckpt import _pools as pools
from jaxckpt.errors import CorruptCheckpointError
from jaxckpt.formats._reread import reread_chunk
from jaxckpt.formats._tsio import Region, chunk_key, zarr_metadata
from jaxckpt.records import (
    PACK_ALIGNMENT,
    PACK_UPLOADS,
    TRAILER_BYTES,
    ChunkRecord,
    SavedLeaf,
    StepLocation,
    chunk_problem,
)
from jaxckpt.storage import Storage, aligned_empty, span_limit


@dataclass(frozen=True)
class RegionRequest:
    """A region of one leaf to read into a fresh numpy array."""

    leaf: SavedLeaf
    region: Region


def plain_leaves(kv: ts.KvStore, leaves: Sequence[SavedLeaf]) -> set[str]:
    """Names of the leaves whose zarr.json has exactly jaxckpt's plain codec chain."""
    futures = {leaf.name: kv.read(f"{leaf.name}/zarr.json") for leaf in leaves if leaf.name}
    plain = set()
    for leaf in leaves:
        if leaf.name is None:
            continue
        try:
            result = futures[leaf.name].result()
            meta = json.loads(result.value) if result.state == "value" else {}
        except (ValueError, json.JSONDecodeError):
            continue  # the TensorStore path reports it with the chunk diagnosis
        if meta.get("codecs") == zarr_metadata(leaf)["codecs"]:
            plain.add(leaf.name)
    return plain


def _cells(region: Region, chunk_shape: Sequence[int]) -> Iterator[Region]:
    """The chunk regions (full chunk extent) that overlap ``region``."""
    ranges = [range(lo // c, -(-hi // c)) for (lo, hi), c in zip(region, chunk_shape, strict=True)]
    for index in itertools.product(*ranges):
        yield tuple((i * c, (i + 1) * c) for i, c in zip(index, chunk_shape, strict=True))


def read_regions(
    storage: Storage,
    loc: StepLocation,
    requests: Sequence[RegionRequest],
    chunks: Mapping[str, Sequence[ChunkRecord]],
    *,
    window_bytes: int = 512 << 20,
    workers: int = PACK_UPLOADS,
) -> list[np.ndarray]:
    """Reads every requested region, checking each chunk against its manifest record.

    Chunk objects are read by a small thread pool through
    :meth:`Storage.read_buffer` (locally: ``readinto`` an aligned buffer, which
    releases the GIL and becomes the array without another copy), at most
    ``window_bytes`` ahead; ``workers`` requests are in flight at once.

    Raises:
      CorruptCheckpointError: a chunk is missing, unlisted, or fails size/CRC32C
        (the step, tree path and chunk are named).
      StorageError: the store failed.
    """
    outputs: list[np.ndarray | None] = [None] * len(requests)
    records = {name: {c.key: c for c in cs} for name, cs in chunks.items()}
    inflight: deque[_Pending] = deque()
    inflight_bytes = 0
    spans = _spans(loc, requests, records, workers)
    # Object stores size their read budget (a local root ignores it).
    storage.plan_restore(
        sum(math.prod(_extent(r.region)) * r.leaf.numpy_dtype.itemsize for r in requests)
    )
    pool = pools.borrow("read", workers)
    try:  # on Ctrl-C (or an error) do not wait for the reads in flight
        for i, request in enumerate(requests):
            leaf = request.leaf
            itemsize = leaf.numpy_dtype.itemsize
            for cell in _cells(request.region, leaf.chunk_shape):
                key = chunk_key(cell, leaf.chunk_shape)
                future: _Result
                if (i, cell) in spans:  # a byte range of a larger object: a slice of one read
                    future = spans[(i, cell)]
                    future.start(pool, storage)
                else:
                    record = records.get(leaf.name or "", {}).get(key)
                    if record is None:  # before any read: never walk a grid the manifest lacks
                        where = _location(storage, loc, leaf, key, None)
                        raise CorruptCheckpointError(f"{where}: not listed in the manifest")
                    future = pool.submit(record.address(loc, leaf.name or "").read, storage)
                inflight.append((i, cell, key, future))
                inflight_bytes += math.prod(leaf.chunk_shape) * itemsize
                while inflight_bytes > window_bytes and inflight:
                    item = inflight.popleft()
                    inflight_bytes -= _place(item, requests, outputs, records, storage, loc)
        while inflight:
            _place(inflight.popleft(), requests, outputs, records, storage, loc)
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return [
        out if out is not None else np.empty(_extent(r.region), r.leaf.numpy_dtype)
        for out, r in zip(outputs, requests, strict=True)
    ]


class _Span:
    """One ranged read of a pack object that covers adjacent chunks."""

    def __init__(self, key: str, offset: int) -> None:
        self.key = key
        self.offset = offset
        self.size = 0
        self.future: Future[bytes | np.ndarray | None] | None = None


class _Slice:
    """One chunk's bytes inside a :class:`_Span` (the span is read once, when first needed)."""

    def __init__(self, span: _Span, offset: int, size: int) -> None:
        self._span = span
        self._offset = offset - span.offset
        self._size = size

    def start(self, pool: Executor, storage: Storage) -> None:
        span = self._span
        if span.future is None:
            span.future = pool.submit(storage.read_range, span.key, span.offset, span.size)

    def result(self) -> bytes | np.ndarray | None:
        assert self._span.future is not None
        data = pools.result(self._span.future)
        if data is None:
            return None
        if isinstance(data, bytes):
            data = np.frombuffer(data, np.uint8)  # a view: no copy
        return data[self._offset : self._offset + self._size]  # short if the pack is


def _spans(
    loc: StepLocation,
    requests: Sequence[RegionRequest],
    records: Mapping[str, Mapping[str, ChunkRecord]],
    workers: int,
) -> dict[tuple[int, Region], _Slice]:
    """Packed chunks, in read order, grouped into ranged reads of adjacent byte ranges,
    each at most the packed bytes over ``workers`` (within the span bounds)."""
    needed = [
        (i, cell, record.address(loc, request.leaf.name or ""))
        for i, request in enumerate(requests)
        for cell in _cells(request.region, request.leaf.chunk_shape)
        if (record := records.get(request.leaf.name or "", {}).get(
            chunk_key(cell, request.leaf.chunk_shape)
        )) is not None and not record.whole_object
    ]  # fmt: skip
    total = sum(address.size for _, _, address in needed)
    limit = span_limit(total, workers)
    out: dict[tuple[int, Region], _Slice] = {}
    span: _Span | None = None
    for i, cell, address in needed:
        key = address.key
        end = address.offset + address.size
        if (  # adjacent: at most the alignment padding in between
            span is None
            or span.key != key
            or not 0 <= address.offset - (span.offset + span.size) < PACK_ALIGNMENT
            or end - span.offset > limit
        ):
            span = _Span(key, address.offset)
        span.size = end - span.offset
        out[(i, cell)] = _Slice(span, address.offset, address.size)
    return out


_Result = Union["Future[bytes | np.ndarray | None]", _Slice]
_Pending = tuple[int, Region, str, _Result]


def _place(
    item: _Pending,
    requests: Sequence[RegionRequest],
    outputs: list[np.ndarray | None],
    records: Mapping[str, Mapping[str, ChunkRecord]],
    storage: Storage,
    loc: StepLocation,
) -> int:
    """Checks one chunk (read again if it fails, see ``_reread``) and copies its overlap
    into the output; returns its size."""
    i, cell, key, future = item
    leaf, region = requests[i].leaf, requests[i].region
    dtype = leaf.numpy_dtype
    record = records.get(leaf.name or "", {}).get(key)
    location = _location(storage, loc, leaf, key, record)
    # A StorageError names the object; a slice waits in pools.result too (Ctrl-C).
    data = future.result() if isinstance(future, _Slice) else pools.result(future)
    if data is None:
        raise CorruptCheckpointError(f"{location}: missing")
    if record is None:
        raise CorruptCheckpointError(f"{location}: not listed in the manifest")
    full = math.prod(leaf.chunk_shape) * dtype.itemsize + TRAILER_BYTES
    if record.size != full:  # a whole chunk (an edge chunk is padded), never reshaped otherwise
        raise CorruptCheckpointError(
            f"{location}: recorded as {record.size} bytes, not the {full} of a whole chunk"
        )
    problem = chunk_problem(data, record)
    if problem is not None:
        address = record.address(loc, leaf.name or "")
        data, problem = reread_chunk(storage, loc, address, record, problem, where=location)
        if data is None:
            raise CorruptCheckpointError(f"{location}: {problem}")
    chunk = np.frombuffer(data, dtype=dtype, count=(len(data) - TRAILER_BYTES) // dtype.itemsize)
    chunk = chunk.reshape(_extent(cell))
    if cell == region:  # the common case: hand out the read buffer itself, no copy
        outputs[i] = chunk
        return len(data)
    out = outputs[i]
    if out is None:
        # Fresh pages cost a fault each on first touch; only resharded reads pay it.
        shape = _extent(region)
        nbytes = math.prod(shape) * dtype.itemsize
        out = outputs[i] = aligned_empty(nbytes).view(dtype).reshape(shape)  # aliasable
    src, dst = [], []
    for (clo, chi), (rlo, rhi) in zip(cell, region, strict=True):
        lo, hi = max(clo, rlo), min(chi, rhi)
        src.append(slice(lo - clo, hi - clo))
        dst.append(slice(lo - rlo, hi - rlo))
    out[tuple(dst)] = chunk[tuple(src)]
    return len(data)


def _location(
    storage: Storage, loc: StepLocation, leaf: SavedLeaf, key: str, record: ChunkRecord | None
) -> str:
    """The chunk, for messages: step, tree path, chunk key, array (and pack)."""
    where = f"{storage.uri.rstrip('/')}/{loc.arrays_prefix}"
    location = f"step {loc.step}: {leaf.path_text}: chunk {key} of {where}{leaf.name}"
    if record is not None:
        location += record.inside()
    return location


def _extent(region: Region) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in region)
