"""TensorStore I/O: host snapshots, zarr v3 chunk writes, reads and checks.

Each array leaf is one zarr v3 array with an uncompressed ``bytes`` codec and
a ``crc32c`` codec, so every stored chunk is ``raw little-endian bytes ||
crc32c(raw)``, which any zarr reader verifies (restores check it in ``_chunkread``). Chunks tile
each shard exactly (or end in a partial edge chunk, stored padded, on an axis a shard holds
whole), so every chunk has exactly one writer: the process that owns the shard's
``replica_id == 0`` copy.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import crc32c as _crc32c
import jax
import numpy as np
import tensorstore as ts

from jaxckpt import _pools as pools
from jaxckpt.commit import reached, watched
from jaxckpt.formats import Planned, Written
from jaxckpt.formats._reread import reread_chunk
from jaxckpt.records import (
    TRAILER_BYTES,
    ChunkRecord,
    SavedLeaf,
    StepLocation,
    chunk_problem,
    dumps,
)
from jaxckpt.storage import Storage, tensorstore_backed

Region = tuple[tuple[int, int], ...]


def region_of(index: tuple[slice, ...], shape: Sequence[int]) -> Region:
    """``(start, stop)`` per axis of a shard index such as ``Shard.index``."""
    return tuple((s.indices(d)[0], s.indices(d)[1]) for s, d in zip(index, shape, strict=True))


@dataclass
class HostArray:
    """A host copy of the parts of one array leaf that this process writes."""

    leaf: SavedLeaf
    pieces: list[tuple[Region, np.ndarray]] = field(default_factory=list)
    held: frozenset[Region] = frozenset()
    """Pieces written for this host's own restores only (a local tier): replicas whose
    ``replica_id == 0`` copy is another host's; not in the part a promotion uploads."""


def zarr_metadata(leaf: SavedLeaf) -> dict[str, Any]:
    """The zarr v3 array metadata jaxckpt writes for ``leaf``."""
    return {
        "shape": list(leaf.shape),
        "data_type": leaf.dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(leaf.chunk_shape)}},
        "chunk_key_encoding": {"name": "default"},
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
    }


def snapshot_array(
    leaf: SavedLeaf, value: Any, *, primary: bool, every_index: bool = False
) -> HostArray:
    """Copies the pieces of ``value`` this process owns into host memory.

    For a ``jax.Array`` these are the addressable shards with ``replica_id ==
    0``; with ``every_index`` (a local tier, which must hold whatever this host
    reads back), one addressable shard of every index, the others marked
    ``held``. A numpy array is written whole by the primary process. The host
    arrays never alias a buffer the caller can mutate or donate: numpy inputs
    are copied, and device buffers are transferred (on CPU the view holds an
    external reference, which makes XLA copy instead of donating).
    """
    host = HostArray(leaf=leaf)
    if isinstance(value, jax.Array):
        if leaf.kind == "key":
            value = jax.random.key_data(value)
        if every_index:
            chosen: dict[Region, Any] = {}
            for s in sorted(value.addressable_shards, key=lambda s: s.replica_id):
                chosen.setdefault(region_of(s.index, value.shape), s)
            shards = list(chosen.values())
            held = {r for r, s in chosen.items() if s.replica_id != 0}
            host.held = frozenset(held)
        else:
            shards = [s for s in value.addressable_shards if s.replica_id == 0]
        for s in shards:
            s.data.copy_to_host_async()
        for s in shards:
            host.pieces.append((region_of(s.index, value.shape), np.asarray(s.data)))
    elif primary:
        array = np.array(value, copy=True)
        host.pieces.append((tuple((0, d) for d in array.shape), array))
    return host


def chunks_of(region: Region, chunk_shape: Sequence[int]) -> Iterator[Region]:
    ranges = [range(lo, hi, c) for (lo, hi), c in zip(region, chunk_shape, strict=True)]
    for starts in itertools.product(*ranges):
        yield tuple(
            (s, min(s + c, hi)) for s, c, (_, hi) in zip(starts, chunk_shape, region, strict=True)
        )


def whole_chunk(piece: np.ndarray, chunk_shape: Sequence[int]) -> np.ndarray:
    """``piece`` (a chunk's region of the data) as the whole chunk zarr stores: an edge
    chunk that the array's end cuts short is padded with the fill value (zeros) to
    ``chunk_shape``, as zarr v3 stores every chunk of a regular grid."""
    if piece.shape == tuple(chunk_shape):
        return piece
    padded = np.zeros(tuple(chunk_shape), piece.dtype)
    padded[tuple(slice(0, n) for n in piece.shape)] = piece
    return padded


def chunk_key(chunk: Region, chunk_shape: Sequence[int]) -> str:
    if not chunk:
        return "c"
    return "c/" + "/".join(str(lo // c) for (lo, _), c in zip(chunk, chunk_shape, strict=True))


def _stored_digest(data: np.ndarray) -> tuple[int, int]:
    """Size of the stored chunk object and CRC32C of its raw bytes (the trailer's value).

    Not the CRC32C of the whole object: the CRC32C of any ``raw || crc32c(raw)``
    is the constant residue 0x48674BC7, so it would not identify the content.
    """
    if sys.byteorder != "little":
        data = data.astype(data.dtype.newbyteorder("<"))
    raw = np.require(data, requirements="C").reshape(-1).view(np.uint8)
    return raw.nbytes + TRAILER_BYTES, int(_crc32c.crc32c(raw.data))


class ArrayWriter:
    """Writes host arrays of one step as zarr v3 through TensorStore."""

    def __init__(
        self, storage: Storage, context: ts.Context, *, max_inflight_bytes: int = 256 << 20
    ) -> None:
        self._storage = storage
        self._context = context
        self._max_inflight = max_inflight_bytes

    def open(self, loc: StepLocation, leaf: SavedLeaf, *, create: bool) -> ts.Future:
        assert leaf.name is not None
        spec: dict[str, Any] = {
            "driver": "zarr3",
            "kvstore": tensorstore_backed(self._storage).kvstore_spec(loc.array_prefix(leaf.name)),
        }
        if create:
            # assume_metadata: no GET + conditional PUT of zarr.json per array (three
            # round trips on S3); write() stores every array's zarr.json at once.
            spec["metadata"] = zarr_metadata(leaf)
            spec["store_data_equal_to_fill_value"] = True  # every chunk is an object
            return ts.open(spec, open=True, assume_metadata=True, context=self._context)
        spec["fill_missing_data_reads"] = False
        return ts.open(spec, open=True, read=True, context=self._context)

    def write_group(self, loc: StepLocation) -> None:
        """The zarr v3 group records that make ``arrays/`` and the attempt openable by zarr-python.

        ``<attempt>/zarr.json`` lets zarr-python open the attempt's prefix as a
        group whose member is ``arrays``; it ignores the step's other records.
        """
        group = {"zarr_format": 3, "node_type": "group", "attributes": {"jaxckpt_step": loc.step}}
        self._storage.write(loc.arrays_prefix + "zarr.json", dumps(group))
        self._storage.write(loc.key("zarr.json"), dumps(group))

    def write_step(
        self, loc: StepLocation, arrays: Sequence[HostArray], *, planned: Planned | None = None
    ) -> Written:
        """:class:`jaxckpt.formats.StepWriter` for the plain format: :meth:`write`, no packs.

        ``planned`` is never called: the records are known when every chunk is written.
        """
        return Written(self.write(loc, arrays), None)

    def write(
        self, loc: StepLocation, arrays: Sequence[HostArray]
    ) -> dict[str, tuple[ChunkRecord, ...]]:
        """Writes every piece, chunk by chunk; returns the chunk records per array.

        At most ``max_inflight_bytes`` of chunk writes are outstanding, which
        bounds TensorStore's transient buffers.
        """
        step = loc.step
        stores = {h.leaf.name: self.open(loc, h.leaf, create=True) for h in arrays if h.leaf.name}
        # Array records and chunks go out together; both are awaited before this returns.
        metadata = self._write_metadata(loc, {n: f.result() for n, f in stores.items()})
        records: dict[str, tuple[ChunkRecord, ...]] = {}
        inflight: deque[tuple[Any, int]] = deque()
        pending_bytes = 0
        first = True
        for host in arrays:
            leaf = host.leaf
            assert leaf.name is not None
            store = stores[leaf.name].result()
            chunk_records = []
            for region, data in host.pieces:
                for chunk in chunks_of(region, leaf.chunk_shape):
                    local = tuple(
                        slice(lo - rlo, hi - rlo)
                        for (lo, hi), (rlo, _) in zip(chunk, region, strict=True)
                    )
                    piece = np.require(data[local], requirements="C")
                    target = store[tuple(slice(lo, hi) for lo, hi in chunk)]
                    fut = target.write(piece, can_reference_source_data_indefinitely=True)
                    size, crc = _stored_digest(whole_chunk(piece, leaf.chunk_shape))
                    key = chunk_key(chunk, leaf.chunk_shape)
                    chunk_records.append(ChunkRecord(key=key, size=size, crc32c=crc))
                    if first:  # this process's first chunk, whichever array it is in
                        first = False
                        if watched("data_started"):  # a crash test: the chunk is durable
                            fut.result()
                        reached("data_started", step)
                    inflight.append((fut, piece.nbytes))
                    pending_bytes += piece.nbytes
                    while pending_bytes > self._max_inflight and inflight:
                        done, nbytes = inflight.popleft()
                        done.result()
                        pending_bytes -= nbytes
            records[leaf.name] = tuple(chunk_records)
        for fut, _ in inflight:
            fut.result()
        for fut in metadata:
            fut.result()
        reached("data_written", step)
        return records

    def _write_metadata(
        self, loc: StepLocation, stores: Mapping[str, ts.TensorStore]
    ) -> list[ts.Future]:
        """Starts writing every array's ``zarr.json``, all requests in flight at once.

        The bytes are TensorStore's own normalized metadata (what ``create``
        would have written). Processes of a multi-host save that share an
        array write identical bytes; the attempt's prefix is this save's alone.
        """
        kv = ts.KvStore.open(
            tensorstore_backed(self._storage).kvstore_spec(loc.arrays_prefix),
            context=self._context,
        ).result()
        futures = [
            kv.write(
                f"{name}/zarr.json", dumps(store.spec(minimal_spec=False).to_json()["metadata"])
            )
            for name, store in stores.items()
        ]
        return futures


def read_region(store: ts.TensorStore, region: Region) -> ts.Future:
    """Starts reading ``region`` of an opened array."""
    return store[tuple(slice(lo, hi) for lo, hi in region)].read()


def full_region(shape: Sequence[int]) -> Region:
    return tuple((0, d) for d in shape)


def expected_chunk_count(leaf: SavedLeaf) -> int:
    if any(d == 0 for d in leaf.shape):
        return 0
    return math.prod(-(-d // c) for d, c in zip(leaf.shape, leaf.chunk_shape, strict=True))


def check_chunks(
    storage: Storage,
    context: ts.Context,
    loc: StepLocation,
    leaf: SavedLeaf,
    chunks: Sequence[ChunkRecord],
    *,
    window: int = 16,
) -> Iterator[tuple[ChunkRecord, str | None, int]]:
    """Re-reads each stored chunk; yields ``(chunk, problem or None, bytes read)``.

    Chunks of a packed step are read from their pack objects by ranged reads. A
    chunk that fails its check is read again before it is reported (``_reread``).
    """
    assert leaf.name is not None
    if not all(c.whole_object for c in chunks):  # byte ranges of larger objects
        yield from _check_by_address(storage, loc, leaf, chunks, window=window)
        return
    kv = ts.KvStore.open(
        tensorstore_backed(storage).kvstore_spec(loc.array_prefix(leaf.name)), context=context
    ).result()
    for chunk, fut in _windowed(chunks, lambda c: kv.read(c.key), window):
        try:
            result = fut.result()
        except Exception as e:  # TensorStore raises ValueError with a status text.
            yield chunk, f"cannot read: {e}", 0
            continue
        if result.state != "value":
            yield chunk, "missing", 0
            continue
        data = result.value
        yield chunk, _recheck(storage, loc, leaf, chunk, data), len(data)


def _windowed(
    chunks: Iterable[ChunkRecord], start: Callable[[ChunkRecord], Any], window: int
) -> Iterator[tuple[ChunkRecord, Any]]:
    """``(chunk, start(chunk))`` in order, with at most ``window`` reads started ahead."""
    queue: deque[tuple[ChunkRecord, Any]] = deque()
    it = iter(chunks)
    while True:
        while len(queue) < window:
            chunk = next(it, None)
            if chunk is None:
                break
            queue.append((chunk, start(chunk)))
        if not queue:
            return
        yield queue.popleft()


def _check_by_address(
    storage: Storage,
    loc: StepLocation,
    leaf: SavedLeaf,
    chunks: Sequence[ChunkRecord],
    *,
    window: int,
) -> Iterator[tuple[ChunkRecord, str | None, int]]:
    def read(chunk: ChunkRecord) -> bytes | np.ndarray | None:
        return chunk.address(loc, leaf.name or "").read(storage)

    with pools.borrow("check", window) as pool:
        for chunk, fut in _windowed(chunks, lambda c: pool.submit(read, c), window):
            try:
                data = fut.result()
            except Exception as e:  # StorageError (names the pack) or a bad record
                yield chunk, f"cannot read: {e}", 0
                continue
            if data is None:
                yield chunk, f"missing{chunk.inside()}", 0
                continue
            problem = _recheck(storage, loc, leaf, chunk, data)
            if problem is not None:
                problem += chunk.inside()
            yield chunk, problem, len(data)


def _recheck(
    storage: Storage, loc: StepLocation, leaf: SavedLeaf, chunk: ChunkRecord, data: Any
) -> str | None:
    """``chunk_problem`` of a chunk's first read, confirmed by reading it again."""
    problem = chunk_problem(data, chunk)
    if problem is None:
        return None
    address = chunk.address(loc, leaf.name or "")
    where = f"step {loc.step}: {leaf.path_text}: chunk {chunk.key}"
    return reread_chunk(storage, loc, address, chunk, problem, where=where)[1] or None
