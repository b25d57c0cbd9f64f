"""Each data format's part of the cost model: what one step asks of the store.

The cost models (``jaxckpt plan``: :func:`jaxckpt.planning._costs.object_plan`, the time
floors of :mod:`jaxckpt.planning._floors`, the cluster-scale model of
:mod:`jaxckpt.planning._scale`) hold what every format shares: the link, the step's
records, the store's rates. What differs between formats is a :class:`FormatCost`,
reached as ``DataFormat.cost`` (:data:`jaxckpt.formats.FORMATS`), given one process's
part of the state (:class:`ProcessShare`); no cost model compares format names.

Pure: no jax, no I/O; the sizes it reads (``storage._options``, ``records._keys``) are
imported when asked, so :mod:`jaxckpt.formats` stays import-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Protocol

__all__ = ["RECORDS_PER_STEP", "FormatCost", "PackedCost", "PlainCost", "ProcessShare"]

RECORDS_PER_STEP = 6
"""The step's records besides the manifest parts: pending, tree, two zarr group records, the
latest hint and the marker (written by the primary process)."""


@dataclass(frozen=True, kw_only=True)
class ProcessShare:
    """What one process of a sharded state holds and writes per step.

    Built by :func:`jaxckpt.planning._costs.process_share` from the options.
    """

    processes: int
    nbytes: float
    """Stored bytes of the process (its shards)."""
    chunks: float
    """Chunks the process writes."""
    chunk_bytes: float
    """The size of one chunk (shards split evenly into chunks of at most the options'
    ``stored_chunk_bytes``)."""
    chunk_stored_bytes: float
    """What one chunk occupies in storage: its bytes and its CRC32C trailer."""
    packs: int
    """Pack objects of the packed format the process writes (``records._keys.pack_count``)."""
    objects_in_flight: int
    """Packs one packed save uploads, and reads one restore issues, at once."""
    uploads_in_flight: int | None = None
    """Packs one packed save uploads at once where fewer than ``objects_in_flight`` (packs
    larger than ``max_object_bytes``: ``records._writebudget.uploads_within``)."""


def in_flight(requests: int, *limits: int) -> int:
    """Requests at once: ``requests`` within every limit, at least 1."""
    return max(1, min(requests, *limits))


class SaveRequests(NamedTuple):
    """The write requests of the primary process's save of one step."""

    written: int
    """Every write request: the data objects, the format's own metadata objects and the
    step's ``records`` (:data:`RECORDS_PER_STEP` and the primary's manifest part)."""
    waited: int
    """Those the data phase waits for (its round trips)."""
    in_flight: int
    carrying: int
    """Of those in flight, the requests carrying bytes at once."""


class FormatCost(Protocol):
    """A data format's objects and requests for one process's part of a step."""

    @property
    def save_round_trips(self) -> int:
        """Sequential round trips of a save, the data writes' own among them."""
        ...

    def data_objects(self, share: ProcessShare) -> float:
        """Data objects one process writes per step (besides its manifest part)."""
        ...

    def step_objects(self, leaves: int) -> int:
        """Objects the primary writes once per step for this format (its arrays' metadata)."""
        ...

    def save_requests(
        self,
        share: ProcessShare,
        *,
        leaves: int,
        records: int,
        connections: int,
        inflight_bytes: int,
    ) -> SaveRequests:
        """The primary's write requests: ``records`` step records besides the format's objects,
        at most ``connections`` in flight and (where the format bounds it) ``inflight_bytes``
        of chunks."""
        ...

    def restore_requests(self, share: ProcessShare) -> int:
        """Ranged reads of one process's restore of its share."""
        ...


@dataclass(frozen=True)
class PlainCost:
    """The plain format: one object per chunk and a ``zarr.json`` per leaf.

    A save writes its chunk objects and manifest part (the primary also every ``zarr.json``
    and the step's records), all of them in one wave of ``connections`` requests with at
    most ``max_inflight_bytes`` of chunks in flight; it has one more sequential round trip
    than packed (the manifest part after the data). A restore is one ranged GET per part
    of a chunk object (``DIRECT_PART_BYTES``), ``objects_in_flight`` at once.
    """

    save_round_trips: int = 5

    def data_objects(self, share: ProcessShare) -> float:
        return share.chunks

    def step_objects(self, leaves: int) -> int:
        return leaves  # a zarr.json per leaf

    def save_requests(
        self,
        share: ProcessShare,
        *,
        leaves: int,
        records: int,
        connections: int,
        inflight_bytes: int,
    ) -> SaveRequests:
        requests = math.ceil(share.chunks) + self.step_objects(leaves) + records
        k = in_flight(requests, connections)
        by_chunk = max(1, int(inflight_bytes // max(1.0, share.chunk_bytes)))
        return SaveRequests(
            written=requests, waited=requests, in_flight=k, carrying=min(k, by_chunk)
        )

    def restore_requests(self, share: ProcessShare) -> int:
        from jaxckpt.storage import DIRECT_PART_BYTES

        return math.ceil(share.chunks) * math.ceil(share.chunk_bytes / DIRECT_PART_BYTES)


@dataclass(frozen=True)
class PackedCost:
    """The packed format: every chunk a byte range of a few pack objects per process.

    A save writes its packs (``pack_count``: each at most ``max_object_bytes``, fewer and
    larger under a store's write budget), ``objects_in_flight`` at once (fewer when
    larger: ``uploads_in_flight``), and beside the last of them its manifest part. A
    restore reads spans of adjacent chunks of one pack, each about the bytes over
    ``objects_in_flight`` (from ``MIN_SPAN_BYTES`` to ``MAX_SPAN_BYTES``).
    """

    save_round_trips: int = 4

    def data_objects(self, share: ProcessShare) -> float:
        return share.packs

    def step_objects(self, leaves: int) -> int:
        return 0  # the arrays' metadata is in tree.json

    def save_requests(
        self,
        share: ProcessShare,
        *,
        leaves: int,
        records: int,
        connections: int,
        inflight_bytes: int,
    ) -> SaveRequests:
        uploads = share.objects_in_flight
        if share.uploads_in_flight is not None:
            uploads = share.uploads_in_flight
        k = in_flight(share.packs, connections, uploads)
        return SaveRequests(
            written=share.packs + records, waited=share.packs, in_flight=k, carrying=k
        )

    def restore_requests(self, share: ProcessShare) -> int:
        """Runs of adjacent chunks of one pack, each about the bytes over
        ``objects_in_flight`` (within ``MIN_SPAN_BYTES`` and ``MAX_SPAN_BYTES``)."""
        from jaxckpt.records._keys import PACK_ALIGNMENT
        from jaxckpt.storage import span_limit

        record = share.chunk_stored_bytes
        limit = span_limit(math.ceil(share.chunks) * record, share.objects_in_flight)
        stride = math.ceil(record / PACK_ALIGNMENT) * PACK_ALIGNMENT  # chunks start aligned
        per_span = 1 if record >= limit else 1 + int((limit - record) // stride)
        packs = max(1, share.packs)
        return packs * math.ceil(math.ceil(share.chunks / packs) / per_span)
