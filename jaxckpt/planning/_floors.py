"""The time floor of one save and one restore per data format, on a far-away object store.

Behind ``jaxckpt plan --devices --leaves``. Pure: no jax, no I/O; every size and
count it uses is the one the formats use (``_keys``, ``storage._options``,
:class:`jaxckpt.CheckpointOptions`).

The link (:class:`Link`): each TCP connection carries at most
``conn_bytes_per_s`` (AWS advises one request in flight per 85-90 MB/s), every
request costs one round trip ``rtt_s`` before its bytes flow (tens of ms on a
far-away store), and all connections of a host share its NIC,
``host_bytes_per_s`` (10 Gb/s: 1.25 GB/s, which AWS fills with about 15
connections). A process keeps at most ``connections`` requests in flight
(``ObjectStoreOptions.request_concurrency``, default 32), and no more than its
format issues at once. Which requests a save and a restore make, and how many of
them fly at once, is each format's (``DataFormat.cost``,
:mod:`jaxckpt.records._layoutcost`): plain writes an object per chunk and a
``zarr.json`` per leaf with at most ``max_inflight_bytes`` of chunks in flight and
reads one ranged GET per chunk; packed writes ``pack_count`` packs,
``objects_in_flight`` at once, and reads spans of adjacent chunks; a restore has
at most ``objects_in_flight`` (:class:`jaxckpt.CheckpointOptions`) reads in flight.

A phase of ``n`` requests moving ``b`` bytes with ``k`` in flight (``k_b`` of
them carrying bytes) takes at least::

    ceil(n / k) * rtt  +  b / min(k_b * conn_bytes_per_s, host_bytes_per_s)

Each connection serves its requests one after another, and each pays its round
trip before its bytes move at the connection's share of the bandwidth. This is
the issue's ``max(bytes / host, bytes / (connections × per-connection), objects /
connections × RTT)`` with the round trips and the transfer added rather than
overlapped: a request's bytes cannot flow before its round trip. To it a
step adds its other sequential round trips: a save has the format's
``save_round_trips`` in all, one of them the data writes' (BUILD.md, Data paths:
the step listing with the pending record, the data, the manifest part (packed:
beside the last packs), the commit batch, the marker); a restore of the newest
step :data:`RESTORE_ROUND_TRIPS`, one of them the data reads' (the latest hint,
the marker, then the tree record and every manifest part at once). The floor is
of the busiest process, the primary, with all processes saving at once on NICs
of their own. Not counted: joining packs in host memory, the CRC32C of each
chunk, the store's request-rate limits per prefix (see ``request_seconds``),
retries, TLS and TCP handshakes (connections are reused), and a writable
open's listing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from jaxckpt.formats import FORMATS, DataFormat
from jaxckpt.planning._costs import _count, _positive
from jaxckpt.records import RECORDS_PER_STEP, ProcessShare, in_flight

__all__ = ["LayoutFloor", "Link", "floor", "floors"]

RESTORE_ROUND_TRIPS = 4
"""Sequential round trips of a restore of the newest step: the latest hint, the marker, the
tree record with every manifest part, and the data reads."""


def _request_concurrency() -> int:
    """``ObjectStoreOptions.request_concurrency``'s default (TensorStore's 32)."""
    from jaxckpt.storage import ObjectStoreOptions

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
    """One data format's objects per process and the floors of one save and one restore."""

    layout: str
    """The format's name."""
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


def floors(
    share: ProcessShare,
    *,
    leaves: int,
    link: Link | None = None,
    max_inflight_bytes: int | None = None,
) -> dict[str, LayoutFloor]:
    """The floor of one save and one restore of every data format, by name (see :func:`floor`).

    >>> from jaxckpt.planning._costs import process_share
    >>> share = process_share(checkpoint_bytes=16 * (16 << 20), leaves=16, devices=8)
    >>> {name: f.save_bound for name, f in floors(share, leaves=16).items()}
    {'plain': 'host bandwidth', 'packed': 'host bandwidth'}
    """
    return {
        f.name: floor(f, share, leaves=leaves, link=link, max_inflight_bytes=max_inflight_bytes)
        for f in FORMATS.values()
    }


def floor(
    data_format: DataFormat,
    share: ProcessShare,
    *,
    leaves: int,
    link: Link | None = None,
    max_inflight_bytes: int | None = None,
) -> LayoutFloor:
    """The floor of one save and one restore in ``data_format`` (see the module docstring).

    Args:
      data_format: the format (:data:`jaxckpt.formats.FORMATS`) whose ``cost`` says its
        requests.
      share: one process's part of the state (:func:`jaxckpt.planning._costs.process_share`).
      leaves: array leaves of the state (the plain format's ``zarr.json`` per leaf).
      link: the store's distance; default :class:`Link` ().
      max_inflight_bytes: the plain save's chunk bytes in flight; default
        :class:`jaxckpt.CheckpointOptions`'s.

    >>> from jaxckpt.formats import PACKED
    >>> from jaxckpt.planning._costs import process_share
    >>> share = process_share(checkpoint_bytes=16 * (16 << 20), leaves=16, devices=8)
    >>> packed = floor(PACKED, share, leaves=16)
    >>> round(packed.save_floor_s, 3), packed.save_bound
    (0.295, 'host bandwidth')
    """
    from jaxckpt.planning._costs import _option

    link = Link() if link is None else link
    inflight_bytes = (
        _option("max_inflight_bytes") if max_inflight_bytes is None else max_inflight_bytes
    )
    cost = data_format.cost
    written, waited, k, carrying = cost.save_requests(
        share,
        leaves=leaves,
        records=RECORDS_PER_STEP + 1,  # the primary's records, and its manifest part
        connections=link.connections,
        inflight_bytes=inflight_bytes,
    )
    save = Phase(
        requests=waited,
        nbytes=share.nbytes,
        in_flight=k,
        carrying=carrying,
        round_trips=cost.save_round_trips - 1,
    )
    reads = cost.restore_requests(share)
    r = in_flight(reads, link.connections, share.objects_in_flight)
    restore = Phase(
        requests=reads,
        nbytes=share.nbytes,
        in_flight=r,
        carrying=r,
        round_trips=RESTORE_ROUND_TRIPS - 1,
    )
    save_terms, restore_terms = save.terms(link), restore.terms(link)
    return LayoutFloor(
        layout=data_format.name,
        objects_per_process=math.ceil(cost.data_objects(share)) + 1,  # + its manifest part
        save_requests_per_process=written,
        restore_requests_per_process=reads,
        save_in_flight=k,
        restore_in_flight=r,
        save_floor_s=sum(save_terms.values()),
        restore_floor_s=sum(restore_terms.values()),
        save_bound=max(save_terms, key=save_terms.__getitem__),
        restore_bound=max(restore_terms, key=restore_terms.__getitem__),
    )
