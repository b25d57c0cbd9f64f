"""The packed layout: each process writes its chunks into a few bounded pack objects.

The plain layout stores every zarr chunk as its own object, so a step costs
(leaves × shards) write requests; at cluster scale that is hundreds of
thousands of requests per checkpoint. In the packed layout a process
concatenates the chunks it owns into pack objects
(``packs/<process>.<k>.bin`` in its attempt; from format 4 under hashed prefixes
``data/<hh>/<step>.<attempt>/``, so its 16 uploads in flight go to up to 16 of
them, see :mod:`jaxckpt.records._keys`): enough of them that
``objects_in_flight`` (16) upload at once, none under ``MIN_PACK_BYTES`` (4
MiB), and as many more as keep each within ``max_object_bytes`` (64 MiB + 64
KiB), whatever the number of leaves (:func:`jaxckpt.records._keys.pack_count`); fewer
where the job's packs would take the store longer than its bytes take the link (the
store's write budget, :mod:`jaxckpt.records._writebudget`: a GCS bucket's ~1,000 writes a
second; S3's 3,500 per prefix over 32 prefixes), each then up to ``(objects_in_flight + 1)
× max_object_bytes``, fewer of them uploading at once so the bytes in flight stay within
that bound. A pack holds whole chunks and starts a new one when the next chunk would take it
over the cap, so two consecutive packs hold more than the cap: a process's
packs per step are at most ``objects_in_flight + 2 × ceil(bytes /
max_object_bytes)`` (half full at worst: chunks just over half the cap). The
default cap's 64 KiB of headroom holds the checksums and alignment of up to
1,024 chunks, so chunks of a power-of-two size fill 64 MiB packs whole. The
chunk bytes are exactly the plain layout's (``raw little-endian ||
crc32c(raw)``), each starting at a multiple of ``PACK_ALIGNMENT``, and the
manifest part records each chunk's pack object and byte offset, so a restore
reads only the chunks its target sharding needs (adjacent ones in one ranged
read), each checked against its CRC32C like a plain chunk.

Memory: a pack is a list of views of the host snapshot (no copy), handed to
:meth:`Storage.start_write`: a local root writes them with ``writev``; an
object store takes an object in one request, so it joins them into the
request body when the upload starts (TensorStore copies the body and holds
the copy until the upload ends). So a save's extra host memory beyond the
snapshot is at most ``(objects_in_flight + 1) × max_object_bytes`` (the
uploads in flight and the one being joined; none on a local root), plus the
clients' own state, and never more than the state.
"""

from __future__ import annotations

import math
import sys
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future

import crc32c as _crc32c
import jax
import numpy as np

from jaxckpt import _pools as pools
from jaxckpt.commit import reached, watched
from jaxckpt.formats import Planned, Written
from jaxckpt.formats._tsio import HostArray, chunk_key, chunks_of, whole_chunk
from jaxckpt.records import (
    MIN_PACK_BYTES,
    PACK_ALIGNMENT,
    PACK_UPLOADS,
    TRAILER_BYTES,
    ChunkRecord,
    SavedLeaf,
    StepLocation,
    merged_pack_limit,
    pack_count,
    pack_name,
    uploads_within,
)
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
                piece = whole_chunk(data[local], leaf.chunk_shape)  # an edge chunk: padded
                if sys.byteorder != "little":
                    piece = piece.astype(piece.dtype.newbyteorder("<"))
                raw = np.require(piece, requirements="C").reshape(-1).view(np.uint8)
                yield leaf, chunk_key(chunk, leaf.chunk_shape), raw


class PackWriter:
    """Writes the host arrays of one step as this process's pack objects.

    Args:
      storage: the tier's storage.
      min_pack_bytes: packs are not split below this (``MIN_PACK_BYTES``).
      max_object_bytes: no pack is larger (unless a single chunk is).
      uploads: packs uploading at once (``PACK_UPLOADS``).
      writes_per_s: the store's write budget for one step of the whole job
        (``records.store_writes_per_s`` of the root; None: none, as on a local root):
        fewer, larger packs where the job's packs would outlast the link
        (``records.pack_count``), fewer of them in flight where they are larger than
        ``max_object_bytes`` (``records.uploads_within``).
    """

    def __init__(
        self,
        storage: Storage,
        *,
        min_pack_bytes: int | None = None,
        max_object_bytes: int | None = None,
        uploads: int = PACK_UPLOADS,
        writes_per_s: float | None = None,
    ) -> None:
        self._storage = storage
        self._min_pack_bytes = MIN_PACK_BYTES if min_pack_bytes is None else min_pack_bytes
        self._max_object_bytes = max_object_bytes
        self._uploads = max(1, uploads)
        self._writes_per_s = writes_per_s

    def _upload(self, key: str, pieces: list[bytes | memoryview]) -> None:
        self._storage.start_write(key, pieces)()

    def write_step(
        self, loc: StepLocation, arrays: Sequence[HostArray], *, planned: Planned | None = None
    ) -> Written:
        """:class:`jaxckpt.formats.StepWriter` for the packed format: :meth:`write`."""
        return Written(*self.write(loc, arrays, planned=planned))

    def write(
        self,
        loc: StepLocation,
        arrays: Sequence[HostArray],
        *,
        planned: Callable[[dict[str, tuple[ChunkRecord, ...]], dict[str, int]], None] | None = None,
    ) -> tuple[dict[str, tuple[ChunkRecord, ...]], dict[str, int]]:
        """Writes every chunk into pack objects, ``uploads`` of them in flight at once.

        Args:
          planned: called with the records and pack sizes (the return value) as
            soon as the last pack is submitted, while packs are still uploading.

        Returns:
          The chunk records per array (each naming its pack and offset) and the
          size of every pack object written, by name relative to the attempt.
        """
        process = jax.process_index()
        sizes = [
            math.prod(host.leaf.chunk_shape) * data.itemsize + TRAILER_BYTES
            for host in arrays
            for region, data in host.pieces
            for chunk in chunks_of(region, host.leaf.chunk_shape)
        ]
        total = sum(sizes)
        cap = self._max_object_bytes
        count = pack_count(
            total,
            min_pack_bytes=self._min_pack_bytes,
            max_object_bytes=cap,
            max_packs=self._uploads,
            processes=jax.process_count(),
            writes_per_s=self._writes_per_s,
        )
        target = math.ceil(total / count) if count else 0
        uploads = self._uploads
        if cap is not None and target > cap:  # the write budget merged packs over the cap
            cap = merged_pack_limit(cap, self._uploads)
            # a pack closes once past the target: at most a chunk (and its padding) over it
            largest = min(cap, target + max(sizes) + PACK_ALIGNMENT)
            uploads = uploads_within(largest, self._uploads, self._max_object_bytes)
        records: dict[str, list[ChunkRecord]] = {h.leaf.name or "": [] for h in arrays}
        packs: dict[str, int] = {}
        # The filling pack: views of the host arrays (no copy) and the bytes between them.
        pieces: list[bytes | memoryview] = []
        filled = 0
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

        with pools.borrow("pack", uploads) as pool:

            def flush() -> None:
                nonlocal pieces, filled, index
                wait(uploads)  # at most `uploads` being written while the next fills
                name = pack_name(process, index)
                packs[name] = filled
                # Views of the snapshot: an object store joins them when it uploads.
                writing.append(pool.submit(self._upload, loc.key(name), pieces))
                pieces, filled = [], 0
                index += 1
                if index == 1 and watched("data_started"):
                    wait(1)  # the first pack alone is durable at data_started, as announced

            for leaf, key, raw in _chunk_views(arrays):
                pad = -filled % PACK_ALIGNMENT
                size = raw.nbytes + TRAILER_BYTES
                if filled and cap is not None and filled + pad + size > cap:
                    flush()  # the chunk would take this pack over the cap
                    pad = 0
                if pad:
                    pieces.append(bytes(pad))  # chunks start aligned
                    filled += pad
                crc = int(_crc32c.crc32c(raw.data))
                records[leaf.name or ""].append(
                    ChunkRecord(
                        key=key,
                        size=size,
                        crc32c=crc,
                        pack=pack_name(process, index),
                        offset=filled,
                    )
                )
                pieces += (raw.data, crc.to_bytes(TRAILER_BYTES, "little"))
                filled += size
                if filled >= target and index < count - 1:
                    flush()
            if pieces:
                flush()
            result = {name: tuple(rs) for name, rs in records.items()}
            if planned is not None:
                planned(result, dict(packs))
            wait(0)
        reached("data_written", loc.step)
        return result, packs
