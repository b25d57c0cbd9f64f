"""One save and one restore at cluster scale: requests, metadata, coordination, store limits.

Behind ``jaxckpt plan --processes N[,N...]``. Pure: no jax, no I/O.

**Counts per process** (metadata requests, manifest parts and summaries read,
coordination calls) are a :class:`~jaxckpt.planning._profiles.Profile`'s
formulas in N, per phase and role (:mod:`jaxckpt.planning._profiles`).

**Data** requests and the data's time floor are the data format's
(``DataFormat.cost``; by default the format new steps are written in,
:func:`~jaxckpt.planning._assumptions.default_format`), from the format model
(:func:`jaxckpt.planning._costs.process_share`,
:func:`jaxckpt.planning._floors.floors`): every leaf sharded over all devices, the
packed layout's packs per process under each store's write rate, as a save counts them
(:mod:`jaxckpt.records._writebudget`).

**Time of a phase**, for the primary (the busiest process)::

    t = data floor (floors: round trips, per-connection and host bandwidth)
      + metadata requests / in flight * rtt
      + (parts read * part bytes + summary bytes) / min(in flight * per-connection, host)
      + the same bytes / PARSE_BYTES_PER_S
      + max(its coordination calls * COORD_CALL_S, cluster calls / COORD_CALLS_PER_S)

A manifest part holds one record of ``RECORD_BYTES`` per chunk of its process
(the constants are :mod:`jaxckpt.planning._assumptions`'). **The store**: the
phase's requests of all processes (metadata and data) against the store's
documented rates (``STORES``; S3 per prefix, GCS per bucket, its ramp ignored:
one burst). ``prefixes`` is the key layout: 1 = today (a step's keys under one
new prefix), K = hashed prefixes that every step reuses (S3 rates apply K times;
GCS's bucket rate once). The limit's time is ``max(writes / write rate, reads /
read rate)``; the phase takes ``max(t, limit time)``; the limit is exceeded when
the limit's time is longer than ``t``; and the profile's retries (``retry_budget_s``)
give up when the throttled wait, the limit's time minus ``t``, exceeds them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from jaxckpt.planning._assumptions import (
    COORD_CALL_S,
    COORD_CALLS_PER_S,
    PARSE_BYTES_PER_S,
    RECORD_BYTES,
    STORES,
    Store,
    default_format,
)
from jaxckpt.planning._profiles import PHASES, ROLES, Profile

if TYPE_CHECKING:
    from jaxckpt.formats import DataFormat

__all__ = ["PhaseCost", "scale_plan", "to_dict"]


@dataclass(frozen=True, kw_only=True)
class PhaseCost:
    """One phase of one checkpoint at ``processes`` processes on one store."""

    store: str
    processes: int
    phase: str
    requests_primary: float
    requests_other: float
    cluster_writes: float
    cluster_reads: float
    metadata_mb_primary: float
    metadata_mb_other: float
    coordination_primary: float
    coordination_cluster: float
    unthrottled_s: float
    limit_s: float
    time_s: float
    limit_exceeded: bool
    fails: bool
    terms: dict[str, float] = field(default_factory=dict)
    """The parts of ``unthrottled_s``, in seconds."""


def scale_plan(
    *,
    processes: Iterable[int],
    profile: Profile,
    state_bytes: float = 1.1e12,
    leaves: int = 2200,
    devices_per_process: int = 8,
    prefixes: int = 1,
    stores: Iterable[str] = ("s3", "gcs"),
    link: Any = None,
    data_format: DataFormat | None = None,
    write_budget: bool = True,
) -> list[PhaseCost]:
    """Every ``(store, N, phase)``'s counts and times (see the module docstring).

    ``data_format`` (default :func:`~jaxckpt.planning._assumptions.default_format`) says the
    data's objects, requests and floor. ``write_budget``: each process writes the packs
    the store's write rate allows (:func:`jaxckpt.records._keys.pack_count` with the
    store's ``writes_per_s`` over the job's prefixes, as a save does); False: as many as
    without a budget (``objects_in_flight``), as saves did before.

    >>> from jaxckpt.planning._profiles import PROFILES
    >>> rows = scale_plan(processes=[1024], profile=PROFILES["before"], stores=["s3"])
    >>> [(r.phase, r.limit_exceeded) for r in rows]
    [('save', False), ('restore', True)]
    >>> rows = scale_plan(processes=[1024], profile=PROFILES["target"], prefixes=256, stores=["s3"])
    >>> [(r.phase, r.limit_exceeded, r.time_s < 10) for r in rows]
    [('save', False, True), ('restore', False, True)]
    """
    from jaxckpt.planning._costs import _count, _positive, process_share
    from jaxckpt.planning._floors import Link

    _positive("state_bytes", state_bytes)
    for name, count in (("leaves", leaves), ("devices_per_process", devices_per_process)):
        _count(name, count)
    _count("prefixes", prefixes)
    link = Link() if link is None else link
    data_format = default_format() if data_format is None else data_format
    unknown = [s for s in stores if s not in STORES]
    if unknown:
        raise ValueError(f"unknown stores {unknown}; choose from {', '.join(STORES)}")
    out = []
    for n in processes:
        _count("processes", n)
        for store_name in stores:
            store = STORES[store_name]
            rate = prefixes if store.per_prefix else 1
            share = process_share(
                checkpoint_bytes=state_bytes,
                leaves=leaves,
                devices=n * devices_per_process,
                devices_per_process=devices_per_process,
                writes_per_s=store.writes_per_s * rate if write_budget else None,
            )
            data = _phase_data(data_format, share, leaves=leaves, link=link)
            part_bytes = share.chunks * RECORD_BYTES
            for phase in PHASES:
                costs = (data[phase], part_bytes, link)
                out.append(_phase_cost(store, rate, n, phase, profile, *costs))
    return out


def _phase_data(data_format: DataFormat, share: Any, *, leaves: int, link: Any) -> dict[str, _Data]:
    """Each phase's data requests per process and the data's floor."""
    from jaxckpt.planning._floors import floor

    cost = data_format.cost
    data_floor = floor(data_format, share, leaves=leaves, link=link)
    objects = cost.data_objects(share)
    return {
        "save": _Data(
            primary_writes=objects + cost.step_objects(leaves),  # + the step's own
            writes=objects,
            floor_s=data_floor.save_floor_s,
        ),
        "restore": _Data(
            reads=data_floor.restore_requests_per_process, floor_s=data_floor.restore_floor_s
        ),
    }


class _Data(NamedTuple):
    """One phase's data requests per process, and the data's time floor."""

    floor_s: float
    primary_writes: float = 0.0
    writes: float = 0.0
    """Of every other process."""
    reads: float = 0.0


def _phase_cost(
    store: Store,
    rate: int,
    n: int,
    phase: str,
    profile: Profile,
    data: _Data,
    part_bytes: float,
    link: Any,
) -> PhaseCost:
    def v(role: str, metric: str) -> float:
        return profile.value(phase, role, metric, n)

    meta = {role: v(role, "meta_reads") + v(role, "meta_writes") for role in ROLES}
    meta_bytes = {
        role: v(role, "parts_read") * part_bytes + v(role, "summary_bytes") for role in ROLES
    }
    coord = {role: v(role, "coordination_calls") for role in ROLES}
    coord_cluster = coord["primary"] + (n - 1) * coord["other"]
    in_flight = link.connections
    wire = min(in_flight * link.conn_bytes_per_s, link.host_bytes_per_s)
    terms = {
        "data": data.floor_s,
        "metadata round trips": math.ceil(meta["primary"] / in_flight) * link.rtt_s,
        "metadata transfer": meta_bytes["primary"] / wire,
        "metadata parsing": meta_bytes["primary"] / PARSE_BYTES_PER_S,
        "coordination": max(coord["primary"] * COORD_CALL_S, coord_cluster / COORD_CALLS_PER_S),
    }
    unthrottled = sum(terms.values())
    writes = v("primary", "meta_writes") + (n - 1) * v("other", "meta_writes")
    writes += data.primary_writes + (n - 1) * data.writes
    reads = v("primary", "meta_reads") + (n - 1) * v("other", "meta_reads") + n * data.reads
    limit = max(writes / (store.writes_per_s * rate), reads / (store.reads_per_s * rate))
    return PhaseCost(
        store=store.name,
        processes=n,
        phase=phase,
        requests_primary=meta["primary"] + data.primary_writes + data.reads,
        requests_other=meta["other"] + data.writes + data.reads,
        cluster_writes=writes,
        cluster_reads=reads,
        metadata_mb_primary=meta_bytes["primary"] / 1e6,
        metadata_mb_other=meta_bytes["other"] / 1e6,
        coordination_primary=coord["primary"],
        coordination_cluster=coord_cluster,
        unthrottled_s=unthrottled,
        limit_s=limit,
        time_s=max(unthrottled, limit),
        limit_exceeded=limit > unthrottled,
        fails=limit - unthrottled > profile.retry_budget_s,
        terms=terms,
    )


def to_dict(cost: PhaseCost) -> dict[str, Any]:
    """A :class:`PhaseCost` as a plain dict (for ``--json``)."""
    return asdict(cost)
