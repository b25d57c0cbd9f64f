"""The time floor of one save and one restore per layout, on a far-away object store.

Behind ``jaxckpt plan --devices --leaves``. Pure: no jax, no I/O; every size and
count it uses is the one the layouts use (``_keys``, ``storage._options``,
:class:`jaxckpt.CheckpointOptions`).

The link (:class:`Link`): each TCP connection carries at most
``conn_bytes_per_s`` (AWS advises one request in flight per 85-90 MB/s), every
request costs one round trip ``rtt_s`` before its bytes flow (tens of ms on a
far-away store), and all connections of a host share its NIC,
``host_bytes_per_s`` (10 Gb/s: 1.25 GB/s, which AWS fills with about 15
connections). A process keeps at most ``connections`` requests in flight
(``ObjectStoreOptions.request_concurrency``, default 32), and no more than its
layout issues at once (``objects_in_flight`` is :class:`jaxckpt.CheckpointOptions`'s):

==============  =========================================  ==========================
phase           requests of one process                    in flight at once
==============  =========================================  ==========================
plain save      its chunk objects, its manifest part; the  ``connections``; chunk bytes
                primary also every ``zarr.json`` and the   at most ``max_inflight_bytes``
                step's records
packed save     its packs (``pack_count``, each at most    ``objects_in_flight`` packs
                ``max_object_bytes``), its manifest part
plain restore   one ranged GET per chunk object            ``objects_in_flight``
packed restore  one ranged GET per span of adjacent        ``objects_in_flight``
                chunks (about the bytes over
                ``objects_in_flight``, from
                ``MIN_SPAN_BYTES`` to ``MAX_SPAN_BYTES``)
==============  =========================================  ==========================

A phase of ``n`` requests moving ``b`` bytes with ``k`` in flight (``k_b`` of
them carrying bytes) takes at least::

    ceil(n / k) * rtt  +  b / min(k_b * conn_bytes_per_s, host_bytes_per_s)

Each connection serves its requests one after another, and each pays its round
trip before its bytes move at the connection's share of the bandwidth. This is
the issue's ``max(bytes / host, bytes / (connections × per-connection), objects /
connections × RTT)`` with the round trips and the transfer added rather than
overlapped: a request's bytes cannot flow before its round trip. To it a
step adds its other sequential round trips: a save has :data:`SAVE_ROUND_TRIPS`
in all (per layout), one of them the data writes'; a restore of the newest step
:data:`RESTORE_ROUND_TRIPS`, one of them the data reads' (the latest hint, the
marker, then the tree record and every manifest part at once). The floor is
of the busiest process, the primary, with all processes saving at once on NICs
of their own. Not counted: joining packs in host memory, the CRC32C of each
chunk, the store's request-rate limits per prefix (see ``request_seconds``),
retries, TLS and TCP handshakes (connections are reused), and a writable
open's listing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from jaxckpt.planning._costs import LAYOUT_NAMES, RECORDS_PER_STEP, ProcessShare, _count, _positive

__all__ = ["LayoutFloor", "Link", "floors"]

SAVE_ROUND_TRIPS = {"plain": 5, "packed": 4}
"""Sequential round trips of a save, the data writes' own among them (BUILD.md, Data paths):
the step listing with the pending record, the data, the manifest part (packed: beside the
last packs), the commit batch, the marker."""
RESTORE_ROUND_TRIPS = 4
"""Sequential round trips of a restore of the newest step: the latest hint, the marker, the
tree record with every manifest part, and the data reads."""


def _request_concurrency() -> int:
    """``ObjectStoreOptions.request_concurrency``'s default (TensorStore's 32)."""
    from jaxckpt.storage._options import ObjectStoreOptions

    return ObjectStoreOptions().request_concurrency


@dataclass(frozen=True, kw_only=True)
class Link:
    """How far away the store is, seen from one process (defaults: AWS's guidance)."""

    conn_bytes_per_s: float = 85e6
    rtt_s: float = 0.020
    host_bytes_per_s: float = 1.25e9
    connections: int = field(default_factory=_request_concurrency)

    def __post_init__(self) -> None:
        for name in ("conn_bytes_per_s", "rtt_s", "host_bytes_per_s"):
            _positive(name, getattr(self, name))
        _count("connections", self.connections)


@dataclass(frozen=True, kw_only=True)
class Phase:
    """``requests`` requests moving ``nbytes``, ``in_flight`` at once (``carrying`` with bytes)."""

    requests: int
    nbytes: float
    in_flight: int
    carrying: int
    round_trips: int
    """Sequential round trips of the protocol besides the requests' own."""

    def terms(self, link: Link) -> dict[str, float]:
        """The floor's parts, in seconds, by what bounds them."""
        rate = min(self.carrying * link.conn_bytes_per_s, link.host_bytes_per_s)
        wire = "host bandwidth" if rate == link.host_bytes_per_s else "per-connection bandwidth"
        return {
            "protocol round trips": self.round_trips * link.rtt_s,
            "request round trips": math.ceil(self.requests / self.in_flight) * link.rtt_s,
            wire: self.nbytes / rate,
        }


@dataclass(frozen=True, kw_only=True)
class LayoutFloor:
    """One layout's objects per process and the floors of one save and one restore."""

    layout: str
    objects_per_process: int
    """Objects one process writes per step: its data objects and its manifest part."""
    save_requests_per_process: int
    """Write requests of the primary (which adds the step's records and plain ``zarr.json``)."""
    restore_requests_per_process: int
    save_in_flight: int
    restore_in_flight: int
    save_floor_s: float
    restore_floor_s: float
    save_bound: str
    """The largest part of the save's floor."""
    restore_bound: str


def _in_flight(requests: int, *limits: int) -> int:
    return max(1, min(requests, *limits))


def _spans(share: ProcessShare) -> int:
    """Ranged reads of a packed restore: runs of adjacent chunks of one pack, each about the
    bytes over ``objects_in_flight`` (within ``MIN_SPAN_BYTES`` and ``MAX_SPAN_BYTES``)."""
    from jaxckpt.records._keys import PACK_ALIGNMENT
    from jaxckpt.records._step import TRAILER_BYTES
    from jaxckpt.storage._options import span_limit

    record = share.chunk_bytes + TRAILER_BYTES
    total = math.ceil(share.chunks) * record
    limit = span_limit(total, share.objects_in_flight)
    stride = math.ceil(record / PACK_ALIGNMENT) * PACK_ALIGNMENT  # chunks start aligned
    per_span = 1 if record >= limit else 1 + int((limit - record) // stride)
    packs = max(1, share.packs)
    return packs * math.ceil(math.ceil(share.chunks / packs) / per_span)


def floors(
    share: ProcessShare,
    *,
    leaves: int,
    link: Link | None = None,
    max_inflight_bytes: int | None = None,
) -> dict[str, LayoutFloor]:
    """The floor of one save and one restore per layout (see the module docstring).

    Args:
      share: one process's part of the state (:func:`jaxckpt.planning._costs.process_share`).
      leaves: array leaves of the state (the plain layout's ``zarr.json`` per leaf).
      link: the store's distance; default :class:`Link` ().
      max_inflight_bytes: the plain save's chunk bytes in flight; default
        :class:`jaxckpt.CheckpointOptions`'s.

    >>> from jaxckpt.planning._costs import process_share
    >>> share = process_share(checkpoint_bytes=16 * (16 << 20), leaves=16, devices=8)
    >>> f = floors(share, leaves=16)
    >>> round(f["packed"].save_floor_s, 3), f["packed"].save_bound
    (0.295, 'host bandwidth')
    """
    from jaxckpt.planning._costs import _option
    from jaxckpt.storage._options import DIRECT_PART_BYTES

    link = Link() if link is None else link
    inflight_bytes = (
        _option("max_inflight_bytes") if max_inflight_bytes is None else max_inflight_bytes
    )
    chunks = math.ceil(share.chunks)
    records = RECORDS_PER_STEP + 1  # the primary's records, and its manifest part
    by_chunk = max(1, int(inflight_bytes // max(1.0, share.chunk_bytes)))
    parts = math.ceil(share.chunk_bytes / DIRECT_PART_BYTES)
    # (write requests, those the data phase waits for, in flight, carrying bytes, objects)
    plain_requests = chunks + leaves + records
    plain_k = _in_flight(plain_requests, link.connections)
    packed_k = _in_flight(share.packs, link.connections, share.objects_in_flight)  # + records
    saves = {
        "plain": (plain_requests, plain_requests, plain_k, min(plain_k, by_chunk), chunks + 1),
        "packed": (share.packs + records, share.packs, packed_k, packed_k, share.packs + 1),
    }
    reads = {"plain": chunks * parts, "packed": _spans(share)}
    out = {}
    for layout in LAYOUT_NAMES:
        written, waited, k, carrying, objects = saves[layout]
        save = Phase(
            requests=waited,
            nbytes=share.nbytes,
            in_flight=k,
            carrying=carrying,
            round_trips=SAVE_ROUND_TRIPS[layout] - 1,
        )
        r = _in_flight(reads[layout], link.connections, share.objects_in_flight)
        restore = Phase(
            requests=reads[layout],
            nbytes=share.nbytes,
            in_flight=r,
            carrying=r,
            round_trips=RESTORE_ROUND_TRIPS - 1,
        )
        save_terms, restore_terms = save.terms(link), restore.terms(link)
        out[layout] = LayoutFloor(
            layout=layout,
            objects_per_process=objects,
            save_requests_per_process=written,
            restore_requests_per_process=reads[layout],
            save_in_flight=k,
            restore_in_flight=r,
            save_floor_s=sum(save_terms.values()),
            restore_floor_s=sum(restore_terms.values()),
            save_bound=max(save_terms, key=save_terms.__getitem__),
            restore_bound=max(restore_terms, key=restore_terms.__getitem__),
        )
    return out
