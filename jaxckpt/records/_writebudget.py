"""The packed layout's write budget: how many pack objects a job's store absorbs per step.

A process's packs fly at once, each on its own connection, so more packs fill more
of its link; but every pack is one write request, and a store absorbs only so many
writes a second across the whole job: a new GCS bucket about 1,000
(:data:`GCS_WRITES_PER_S`), S3 3,500 per prefix (:data:`S3_WRITES_PER_PREFIX_S`)
over the step's hashed prefixes (:data:`~jaxckpt.records._keys.SPREAD_SLOTS`). With
``N`` processes of ``b`` bytes each writing ``p`` packs, the store takes
``N p / rate`` seconds for the packs and a process ``r + b / (k c)`` to send its bytes:
a round trip ``r`` (:data:`REQUEST_RTT_S`), then ``c`` (:data:`CONN_BYTES_PER_S`) per
connection, ``k`` of them at once. The first grows with ``p``, the second shrinks
(``k`` is ``p``, up to ``objects_in_flight``), and :func:`budget_packs` takes the
count where they cross (for large shares, without a memory bound, near
``p = sqrt(b * rate / (N * c))``). A small job's packs take the store less than a
round trip, so it keeps the count it had without a budget.

Each process computes it from what it knows alone (the process count, its own bytes,
its root's scheme), so nothing is coordinated; readers take every pack's name from the
manifest, so the count is not part of the format. Where it is below what the link
wants, packs are larger than ``max_object_bytes``: :func:`uploads_within` then keeps
the bytes in flight within the same memory bound (``(objects_in_flight + 1) ×
max_object_bytes``), and no pack is larger than that bound or
:data:`MAX_MERGED_PACK_BYTES`. A 70B state with Adam (1.1 TB) on a new GCS bucket:

>>> def packs(processes):
...     return budget_packs(1.1e12 / processes, processes=processes,
...                         writes_per_s=GCS_WRITES_PER_S, uploads=16,
...                         max_object_bytes=64 << 20, fewest=1, most=16)
>>> packs(1024), packs(8192)
(4, 1)

Pure: no jax, no numpy, no I/O.
"""

from __future__ import annotations

__all__ = [
    "CONN_BYTES_PER_S",
    "GCS_WRITES_PER_S",
    "MAX_MERGED_PACK_BYTES",
    "REQUEST_RTT_S",
    "S3_WRITES_PER_PREFIX_S",
    "budget_packs",
    "merged_pack_limit",
    "store_writes_per_s",
    "uploads_within",
]

CONN_BYTES_PER_S = 85e6
"""What one connection to a far-away store carries (AWS advises one request in flight per
85-90 MB/s)."""
REQUEST_RTT_S = 0.020
"""A request's round trip to a far-away store, before its bytes flow (tens of ms)."""
GCS_WRITES_PER_S = 1000.0
"""Object writes a second a new GCS bucket absorbs (it ramps at most 2x per 20 minutes)."""
S3_WRITES_PER_PREFIX_S = 3500.0
"""PUT/DELETE requests a second S3 absorbs per partitioned prefix."""
MAX_MERGED_PACK_BYTES = 4 << 30
"""A pack is never larger than this (S3 takes at most 5 GB in one PUT, and TensorStore's s3
driver refuses larger values)."""


def store_writes_per_s(uri: str, *, prefixes: int) -> float | None:
    """The writes a second the store of root ``uri`` absorbs for one step's packs: a GCS
    bucket's, S3's per prefix over the ``prefixes`` the step's objects spread over; None
    (no budget) for a local root and anything else.

    >>> [store_writes_per_s(uri, prefixes=32) for uri in ("gs://b/run", "s3://b/run", "/x")]
    [1000.0, 112000.0, None]
    """
    scheme = uri.partition("://")[0] if "://" in uri else "file"
    if scheme == "gs":
        return GCS_WRITES_PER_S
    if scheme == "s3":
        return S3_WRITES_PER_PREFIX_S * prefixes
    return None


def budget_packs(
    nbytes: float,
    *,
    processes: int,
    writes_per_s: float,
    uploads: int,
    max_object_bytes: int | None,
    fewest: int,
    most: int,
) -> int:
    """The packs per process, from ``fewest`` to ``most``, that make a step quickest: the
    job's packs at the store's ``writes_per_s`` against a round trip and the process's
    ``nbytes`` over its uploads in flight (:func:`uploads_within`) at
    :data:`CONN_BYTES_PER_S` each (see the module docstring). The first takes longer
    with every pack, the second less, so the best count is where they cross, found by
    bisection.

    >>> budget_packs(1.07e9, processes=1024, writes_per_s=GCS_WRITES_PER_S, uploads=16,
    ...              max_object_bytes=64 << 20, fewest=1, most=16)
    4
    """
    if not 1 <= fewest <= most:
        raise ValueError(f"need 1 <= fewest <= most, got {fewest} and {most}")

    def store_s(packs: int) -> float:
        return max(1, processes) * packs / writes_per_s

    def send_s(packs: int) -> float:
        flying = min(packs, uploads_within(nbytes / packs, uploads, max_object_bytes))
        return REQUEST_RTT_S + nbytes / (flying * CONN_BYTES_PER_S)

    lo, hi = fewest, most  # the first count whose store time reaches its send time
    while lo < hi:
        mid = (lo + hi) // 2
        if store_s(mid) >= send_s(mid):
            hi = mid
        else:
            lo = mid + 1
    if lo > fewest and max(store_s(lo - 1), send_s(lo - 1)) < max(store_s(lo), send_s(lo)):
        return lo - 1
    return lo


def merged_pack_limit(max_object_bytes: int, uploads: int) -> int:
    """The largest pack the write budget merges: the memory bound of ``uploads`` packs
    of ``max_object_bytes`` and the one filling, within :data:`MAX_MERGED_PACK_BYTES`.

    >>> merged_pack_limit(64 << 20, 16) >> 20, merged_pack_limit(1 << 30, 16) >> 30
    (1088, 4)
    """
    return min(MAX_MERGED_PACK_BYTES, (uploads + 1) * max_object_bytes)


def uploads_within(pack_bytes: float, uploads: int, max_object_bytes: int | None) -> int:
    """Packs of ``pack_bytes`` uploading at once: ``uploads``, fewer where packs larger than
    ``max_object_bytes`` would hold more than ``(uploads + 1) × max_object_bytes`` in
    flight; at least 1.

    >>> uploads_within(64 << 20, 16, 64 << 20), uploads_within(256 << 20, 16, 64 << 20)
    (16, 4)
    """
    if max_object_bytes is None or pack_bytes <= max_object_bytes:
        return max(1, uploads)
    return max(1, min(uploads, int((uploads + 1) * max_object_bytes // pack_bytes)))
