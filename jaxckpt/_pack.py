"""The packed layout: each process writes its chunks into a few bounded pack objects.

The plain layout stores every zarr chunk as its own object, so a step costs
(leaves × shards) write requests; at cluster scale that is hundreds of
thousands of requests per checkpoint. In the packed layout a process
concatenates the chunks it owns into ``MAX_PACKS`` objects or fewer, or as many
as keep each under ``max_object_bytes`` (a chunk larger than that, which
``chunk_bytes`` well below it prevents, is written alone in its pack)
(``attempts/<step>/<attempt>/packs/<process>.<k>.bin``), whatever the number
of leaves. The chunk bytes are exactly the plain layout's (``raw little-endian
|| crc32c(raw)``), each starting at a multiple of ``PACK_ALIGNMENT``, and the
manifest part records each chunk's pack object and byte offset, so a restore
reads only the chunks its target sharding needs (adjacent ones in one ranged
read), each checked against its CRC32C like a plain chunk.

Memory: a pack is built in host memory before its single write (object stores
take an object in one request). Packs are sized ``ceil(bytes / count)`` (at
least ``min_pack_bytes``, at most ``max_object_bytes``), and up to
``PACK_UPLOADS`` are written at once while the next one fills, so a save's
extra memory is at most ``(PACK_UPLOADS + 1) × max_object_bytes``, and never
more than the state once.
"""

from __future__ import annotations

import math
import sys
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from typing import cast

import crc32c as _crc32c
import jax
import numpy as np

from jaxckpt import _pools as pools
from jaxckpt._layout import (
    MIN_PACK_BYTES,
    PACK_ALIGNMENT,
    PACK_UPLOADS,
    StepLocation,
    pack_count,
    pack_name,
)
from jaxckpt._phases import reached
from jaxckpt._records import TRAILER_BYTES, ChunkRecord
from jaxckpt._tree import SavedLeaf
from jaxckpt._tsio import HostArray, chunk_key, chunks_of
from jaxckpt.storage import Storage


def _chunk_views(arrays: Sequence[HostArray]) -> Iterator[tuple[SavedLeaf, str, np.ndarray]]:
    """``(leaf, chunk key, raw little-endian bytes)`` of every chunk this process owns."""
    for host in arrays:
        leaf = host.leaf
        for region, data in host.pieces:
            for chunk in chunks_of(region, leaf.chunk_shape):
                local = tuple(
                    slice(lo - rlo, hi - rlo)
                    for (lo, hi), (rlo, _) in zip(chunk, region, strict=True)
                )
                piece = data[local]
                if sys.byteorder != "little":
                    piece = piece.astype(piece.dtype.newbyteorder("<"))
                raw = np.require(piece, requirements="C").reshape(-1).view(np.uint8)
                yield leaf, chunk_key(chunk, leaf.chunk_shape), raw


class PackWriter:
    """Writes the host arrays of one step as this process's pack objects."""

    def __init__(
        self,
        storage: Storage,
        *,
        min_pack_bytes: int | None = None,
        max_object_bytes: int | None = None,
    ) -> None:
        self._storage = storage
        self._min_pack_bytes = MIN_PACK_BYTES if min_pack_bytes is None else min_pack_bytes
        self._max_object_bytes = max_object_bytes

    def write(
        self, loc: StepLocation, arrays: Sequence[HostArray]
    ) -> tuple[dict[str, tuple[ChunkRecord, ...]], dict[str, int]]:
        """Writes every chunk into pack objects, ``PACK_UPLOADS`` of them in flight at once.

        Returns:
          The chunk records per array (each naming its pack and offset) and the
          size of every pack object written, by name relative to the attempt.
        """
        process = jax.process_index()
        total = sum(
            math.prod(hi - lo for lo, hi in chunk) * data.itemsize + TRAILER_BYTES
            for host in arrays
            for region, data in host.pieces
            for chunk in chunks_of(region, host.leaf.chunk_shape)
        )
        cap = self._max_object_bytes
        count = pack_count(total, min_pack_bytes=self._min_pack_bytes, max_object_bytes=cap)
        target = math.ceil(total / count) if count else 0
        records: dict[str, list[ChunkRecord]] = {h.leaf.name or "": [] for h in arrays}
        packs: dict[str, int] = {}
        buffer = bytearray()
        index = 0
        writing: deque[Future[None]] = deque()
        started = False

        def wait(below: int) -> None:
            """Waits for the oldest uploads until fewer than ``below`` are in flight."""
            nonlocal started
            while len(writing) >= max(below, 1):
                writing.popleft().result()
                if not started:  # this process's first pack is durable
                    started = True
                    reached("data_started", loc.step)

        with pools.borrow("pack", PACK_UPLOADS) as pool:

            def flush() -> None:
                nonlocal buffer, index
                wait(PACK_UPLOADS)  # at most PACK_UPLOADS being written while the next fills
                name = pack_name(process, index)
                packs[name] = len(buffer)
                # The buffer itself (no copy); it is never touched again.
                writing.append(pool.submit(self._storage.write, loc.key(name), cast(bytes, buffer)))
                buffer = bytearray()
                index += 1

            for leaf, key, raw in _chunk_views(arrays):
                pad = -len(buffer) % PACK_ALIGNMENT
                size = raw.nbytes + TRAILER_BYTES
                if buffer and cap is not None and len(buffer) + pad + size > cap:
                    flush()  # the chunk would take this pack over the cap
                    pad = 0
                name = pack_name(process, index)
                buffer += bytes(pad)  # chunks start aligned
                crc = int(_crc32c.crc32c(raw.data))
                records[leaf.name or ""].append(
                    ChunkRecord(
                        key=key,
                        size=raw.nbytes + TRAILER_BYTES,
                        crc32c=crc,
                        pack=name,
                        offset=len(buffer),
                    )
                )
                buffer += raw.data
                buffer += crc.to_bytes(TRAILER_BYTES, "little")
                if len(buffer) >= target and index < count - 1:
                    flush()
            if buffer:
                flush()
            wait(0)
        reached("data_written", loc.step)
        return {name: tuple(rs) for name, rs in records.items()}, packs
