"""One save and one restore at cluster scale: requests, metadata, coordination, store limits.

Behind ``jaxckpt plan --processes N[,N...]``. Pure: no jax, no I/O.

**Counts per process** are formulas ``a + b*N`` (:class:`Linear`) of the
process count N, one set per phase (a save until its manager is closed, a
restore likewise) and role (the primary; every other process): metadata reads
(GET, HEAD and LIST of records, manifest parts, markers, listings), metadata
writes (PUT, DELETE), manifest parts read, bytes of per-process summaries read,
and coordination-service calls. A :class:`Profile` holds one set:

* ``before``: fit by least squares to ``python scripts/bench.py scale`` at 2, 4,
  8 and 16 real processes (:data:`BEFORE`, the code of 2026-12-04), or to any
  run's ``--json`` (:func:`fit_profile`);
* ``target``: issue 35's target, derived from the protocol it asks for: every
  count constant per process; the primary gathers one small summary per
  process (:data:`SUMMARY_BYTES`) through the coordination service; a restore
  reads its own manifest part and one more (the part holding its replicated
  chunks).

**Data** requests and the data's time floor are the packed layout's, from the
layout model (:func:`jaxckpt.planning._costs.process_share`,
:func:`jaxckpt.formats._floors.floors`):
every leaf sharded over all devices.

**Time of a phase**, for the primary (the busiest process)::

    t = data floor (floors: round trips, per-connection and host bandwidth)
      + metadata requests / in flight * rtt
      + (parts read * part bytes + summary bytes) / min(in flight * per-connection, host)
      + the same bytes / PARSE_BYTES_PER_S
      + max(its coordination calls * COORD_CALL_S, cluster calls / COORD_CALLS_PER_S)

A manifest part holds one record of :data:`RECORD_BYTES` per chunk of its
process. **The store**: the phase's requests of all processes (metadata and
data) against the store's documented rates (:data:`STORES`; S3 per prefix,
GCS per bucket, its ramp ignored: one burst). ``prefixes`` is the key layout:
1 = today (a step's keys under one new prefix), K = hashed prefixes that
every step reuses (S3 rates apply K times; GCS's bucket rate once). The
limit's time is ``max(writes / write rate, reads / read rate)``; the phase
takes ``max(t, limit time)``; the limit is exceeded when the limit's time is
longer than ``t``; and today's retries (:data:`RETRY_BUDGET_S`) give up when the
throttled wait, the limit's time minus ``t``, exceeds them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "PROFILES",
    "STORES",
    "Linear",
    "PhaseCost",
    "Profile",
    "Store",
    "assumptions",
    "fit_profile",
    "scale_plan",
    "to_dict",
]

METRICS = ("meta_reads", "meta_writes", "parts_read", "summary_bytes", "coordination_calls")
PHASES = ("save", "restore")
ROLES = ("primary", "other")

RECORD_BYTES = 68
"""Bytes of one chunk record in a manifest part (issue 35: 1.2 MB for 17,600 records)."""
SUMMARY_BYTES = 256
"""A per-process summary of the target protocol: pack names, sizes, the part's CRC32C."""
PARSE_BYTES_PER_S = 50e6
"""JSON records parsed and checked per second by one process (an assumption)."""
COORD_CALL_S = 1e-3
"""One blocking coordination-service call across a cluster network (an assumption; 0.41 ms
was measured on loopback)."""
COORD_CALLS_PER_S = 10_000.0
"""Calls per second the coordination service answers (8,300 gets/s measured on loopback
from 8 threads on a 2-core machine)."""
RETRY_BUDGET_S = 16.0
"""How long today's retries wait at most: 6 attempts, 0.5-8 s backoff."""


@dataclass(frozen=True, kw_only=True)
class Linear:
    """``a + b * N``."""

    a: float
    b: float = 0.0

    def at(self, n: float) -> float:
        """The value at ``n`` processes (never below 0)."""
        return max(0.0, self.a + self.b * n)

    def __str__(self) -> str:
        if not self.b:
            return f"{self.a:.3g}"
        return f"{self.a:.3g} {'+' if self.b >= 0 else '-'} {abs(self.b):.3g}·N"


Formulas = Mapping[str, Mapping[str, Mapping[str, Linear]]]
"""``formulas[phase][role][metric]``."""


@dataclass(frozen=True, kw_only=True)
class Profile:
    """Per-process counts as formulas in N, and where they come from."""

    name: str
    source: str
    formulas: Formulas

    def value(self, phase: str, role: str, metric: str, n: int) -> float:
        return self.formulas[phase][role][metric].at(n)


@dataclass(frozen=True, kw_only=True)
class Store:
    """An object store's documented request rates."""

    name: str
    writes_per_s: float
    reads_per_s: float
    per_prefix: bool
    """True: the rates apply per prefix (S3's partitions); False: per bucket."""
    note: str


STORES = {
    "s3": Store(
        name="s3",
        writes_per_s=3500,
        reads_per_s=5500,
        per_prefix=True,
        note="3,500 PUT/DELETE and 5,500 GET/HEAD/LIST per second per partitioned prefix",
    ),
    "gcs": Store(
        name="gcs",
        writes_per_s=1000,
        reads_per_s=5000,
        per_prefix=False,
        note="~1,000 writes and 5,000 reads per second per new bucket (its 2x per 20 min "
        "ramp ignored: one checkpoint is one burst)",
    ),
}


def _table(rows: dict[str, dict[str, tuple[float, float]]]) -> dict[str, dict[str, Linear]]:
    return {role: {m: Linear(a=a, b=b) for m, (a, b) in row.items()} for role, row in rows.items()}


BEFORE = Profile(
    name="before",
    source="least-squares fit of a + b*N to `python scripts/bench.py scale` at 2, 4, 8 and 16 "
    "processes (main a05940e, 2026-12-04; every count lay exactly on its line)",
    formulas={
        "save": _table(
            {
                "primary": {
                    "meta_reads": (4.0, 1.0),  # the commit reads the N - 1 other parts
                    "meta_writes": (8.0, 0.0),
                    "parts_read": (-1.0, 1.0),
                    "summary_bytes": (0.0, 0.0),
                    "coordination_calls": (5.0, 1.0),  # closing reads N keys
                },
                "other": {
                    "meta_reads": (4.0, 0.0),
                    "meta_writes": (1.0, 0.0),
                    "parts_read": (0.0, 0.0),
                    "summary_bytes": (0.0, 0.0),
                    "coordination_calls": (4.0, 0.0),
                },
            }
        ),
        "restore": _table(
            {
                "primary": {
                    "meta_reads": (5.0, 1.0),  # every manifest part
                    "meta_writes": (0.0, 0.0),
                    "parts_read": (0.0, 1.0),
                    "summary_bytes": (0.0, 0.0),
                    "coordination_calls": (5.0, 2.0),  # a gather and the close: N keys each
                },
                "other": {
                    "meta_reads": (1.0, 1.0),
                    "meta_writes": (0.0, 0.0),
                    "parts_read": (0.0, 1.0),
                    "summary_bytes": (0.0, 0.0),
                    "coordination_calls": (4.0, 1.0),  # a gather reads N keys
                },
            }
        ),
    },
)

TARGET = Profile(
    name="target",
    source="issue 35's target, derived from the protocol it asks for: today's constant terms; "
    f"the commit gathers a {SUMMARY_BYTES} B summary per process through one directory read "
    "instead of reading parts; a restore reads its own part and one more; a gather is a "
    "set, a barrier and one directory read",
    formulas={
        "save": _table(
            {
                "primary": {
                    "meta_reads": (5.0, 0.0),
                    "meta_writes": (8.0, 0.0),
                    "parts_read": (0.0, 0.0),
                    "summary_bytes": (0.0, SUMMARY_BYTES),
                    "coordination_calls": (7.0, 0.0),
                },
                "other": {
                    "meta_reads": (4.0, 0.0),
                    "meta_writes": (1.0, 0.0),
                    "parts_read": (0.0, 0.0),
                    "summary_bytes": (0.0, 0.0),
                    "coordination_calls": (5.0, 0.0),
                },
            }
        ),
        "restore": _table(
            {
                "primary": {
                    "meta_reads": (7.0, 0.0),
                    "meta_writes": (0.0, 0.0),
                    "parts_read": (2.0, 0.0),
                    "summary_bytes": (0.0, 0.0),
                    "coordination_calls": (9.0, 0.0),
                },
                "other": {
                    "meta_reads": (3.0, 0.0),
                    "meta_writes": (0.0, 0.0),
                    "parts_read": (2.0, 0.0),
                    "summary_bytes": (0.0, 0.0),
                    "coordination_calls": (7.0, 0.0),
                },
            }
        ),
    },
)

PROFILES = {p.name: p for p in (BEFORE, TARGET)}


def _fit(points: Iterable[tuple[float, float]]) -> Linear:
    """Least squares ``a + b*N`` through ``(N, value)`` points (a constant for one N)."""
    pts = list(points)
    if not pts:
        raise ValueError("no measured points to fit")
    mean_n = sum(n for n, _ in pts) / len(pts)
    mean_v = sum(v for _, v in pts) / len(pts)
    spread = sum((n - mean_n) ** 2 for n, _ in pts)
    if spread == 0:
        return Linear(a=mean_v)
    b = sum((n - mean_n) * (v - mean_v) for n, v in pts) / spread
    return Linear(a=round(mean_v - b * mean_n, 3), b=round(b, 3))


def fit_profile(report: Mapping[str, Any], name: str = "measured") -> Profile:
    """A profile fit to a ``scripts/bench.py scale --json`` report (least squares per count).

    >>> run = lambda n, k: {"processes": n, "summary": {p: {r: {
    ...     "meta_reads": k, "meta_writes": 1, "manifest_gets": n, "coordination_calls": 2 * n}
    ...     for r in ("primary", "others_max")} for p in ("save", "restore")}}
    >>> f = fit_profile({"runs": [run(2, 5), run(4, 7)]}).formulas["restore"]["other"]
    >>> str(f["meta_reads"]), str(f["parts_read"]), str(f["coordination_calls"])
    ('3 + 1·N', '0 + 1·N', '0 + 2·N')
    """
    runs = list(report.get("runs", ()))
    if not runs:
        raise ValueError("the report has no runs")
    keys = {
        "meta_reads": "meta_reads",
        "meta_writes": "meta_writes",
        "parts_read": "manifest_gets",
        "coordination_calls": "coordination_calls",
    }
    formulas: dict[str, dict[str, dict[str, Linear]]] = {}
    for phase in PHASES:
        formulas[phase] = {}
        for role, measured in (("primary", "primary"), ("other", "others_max")):
            row = {
                metric: _fit(
                    (float(r["processes"]), float(r["summary"][phase][measured][key])) for r in runs
                )
                for metric, key in keys.items()
            }
            row["summary_bytes"] = Linear(a=0.0)
            formulas[phase][role] = row
    ns = sorted(int(r["processes"]) for r in runs)
    return Profile(
        name=name,
        source=f"least-squares fit of a + b*N to a scale report at {ns} processes",
        formulas=formulas,
    )


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
    fails_today: bool
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
) -> list[PhaseCost]:
    """Every ``(store, N, phase)``'s counts and times (see the module docstring).

    >>> rows = scale_plan(processes=[1024], profile=PROFILES["before"], stores=["s3"])
    >>> [(r.phase, r.limit_exceeded) for r in rows]
    [('save', False), ('restore', True)]
    >>> rows = scale_plan(processes=[1024], profile=PROFILES["target"], prefixes=256, stores=["s3"])
    >>> [(r.phase, r.limit_exceeded, r.time_s < 10) for r in rows]
    [('save', False, True), ('restore', False, True)]
    """
    from jaxckpt.formats._floors import Link, floors
    from jaxckpt.planning._costs import _count, _positive, process_share

    _positive("state_bytes", state_bytes)
    for name, count in (("leaves", leaves), ("devices_per_process", devices_per_process)):
        _count(name, count)
    _count("prefixes", prefixes)
    link = Link() if link is None else link
    unknown = [s for s in stores if s not in STORES]
    if unknown:
        raise ValueError(f"unknown stores {unknown}; choose from {', '.join(STORES)}")
    out = []
    for n in processes:
        _count("processes", n)
        share = process_share(
            checkpoint_bytes=state_bytes,
            leaves=leaves,
            devices=n * devices_per_process,
            devices_per_process=devices_per_process,
        )
        floor = floors(share, leaves=leaves, link=link)["packed"]
        part_bytes = share.chunks * RECORD_BYTES
        data = {
            "save": (share.packs, 0.0, floor.save_floor_s),
            "restore": (0.0, floor.restore_requests_per_process, floor.restore_floor_s),
        }
        for store_name in stores:
            store = STORES[store_name]
            rate = prefixes if store.per_prefix else 1
            for phase in PHASES:
                costs = (data[phase], part_bytes, link)
                out.append(_phase_cost(store, rate, n, phase, profile, *costs))
    return out


def _phase_cost(
    store: Store,
    rate: int,
    n: int,
    phase: str,
    profile: Profile,
    data: tuple[float, float, float],
    part_bytes: float,
    link: Any,
) -> PhaseCost:
    def v(role: str, metric: str) -> float:
        return profile.value(phase, role, metric, n)

    data_writes, data_reads, data_floor = data
    meta = {role: v(role, "meta_reads") + v(role, "meta_writes") for role in ROLES}
    meta_bytes = {
        role: v(role, "parts_read") * part_bytes + v(role, "summary_bytes") for role in ROLES
    }
    coord = {role: v(role, "coordination_calls") for role in ROLES}
    coord_cluster = coord["primary"] + (n - 1) * coord["other"]
    in_flight = link.connections
    wire = min(in_flight * link.conn_bytes_per_s, link.host_bytes_per_s)
    terms = {
        "data": data_floor,
        "metadata round trips": math.ceil(meta["primary"] / in_flight) * link.rtt_s,
        "metadata transfer": meta_bytes["primary"] / wire,
        "metadata parsing": meta_bytes["primary"] / PARSE_BYTES_PER_S,
        "coordination": max(coord["primary"] * COORD_CALL_S, coord_cluster / COORD_CALLS_PER_S),
    }
    unthrottled = sum(terms.values())
    writes = v("primary", "meta_writes") + (n - 1) * v("other", "meta_writes") + n * data_writes
    reads = v("primary", "meta_reads") + (n - 1) * v("other", "meta_reads") + n * data_reads
    limit = max(writes / (store.writes_per_s * rate), reads / (store.reads_per_s * rate))
    return PhaseCost(
        store=store.name,
        processes=n,
        phase=phase,
        requests_primary=meta["primary"] + data_writes + data_reads,
        requests_other=meta["other"] + data_writes + data_reads,
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
        fails_today=limit - unthrottled > RETRY_BUDGET_S,
        terms=terms,
    )


def assumptions(
    profile: Profile, *, prefixes: int, link: Any, state_bytes: float, leaves: int, dpp: int
) -> list[str]:
    """Every assumption of :func:`scale_plan`, one line each (printed with its table)."""
    lines = [
        f"state: {state_bytes / 1e9:,.0f} GB (70B parameters with Adam: ~16 B each), "
        f"{leaves:,} leaves, each sharded over all devices, {dpp} devices per process, "
        "packed layout (jaxckpt.planning._costs.process_share)",
        f"counts per process: profile {profile.name!r}: {profile.source}",
        "data requests and their floor: the packed layout's (jaxckpt.formats._floors), "
        f"{link.conn_bytes_per_s / 1e6:g} MB/s per connection, {link.rtt_s * 1e3:g} ms per "
        f"request, {link.host_bytes_per_s / 1e9:g} GB/s per host, "
        f"{link.connections} requests in flight",
        f"metadata: {RECORD_BYTES} B per chunk record in a manifest part, parsed at "
        f"{PARSE_BYTES_PER_S / 1e6:g} MB/s; other records' bytes not counted",
        f"coordination: {COORD_CALL_S * 1e3:g} ms per blocking call, the service answers "
        f"{COORD_CALLS_PER_S:,.0f} calls/s",
        "times are of the primary (the busiest process), all processes at once, "
        "no failures; an open's requests and listings of earlier steps are not counted",
        f"key layout: {prefixes} prefix(es) per step"
        + (" (today: a step's keys under one new prefix)" if prefixes == 1 else " (hashed)"),
    ]
    lines += [f"store {s.name}: {s.note}" for s in STORES.values()]
    lines.append(
        "a phase takes max(its own time, its requests at the store's rate); 'fails' when "
        f"the throttled wait exceeds today's retry budget (~{RETRY_BUDGET_S:g} s: 6 attempts, "
        "0.5-8 s)"
    )
    lines.append(
        "formulas (per process; N = processes): "
        + "; ".join(
            f"{phase} {role} {metric} = {profile.formulas[phase][role][metric]}"
            for phase in PHASES
            for role in ROLES
            for metric in METRICS
            if str(profile.formulas[phase][role][metric]) != "0"
        )
    )
    return lines


def to_dict(cost: PhaseCost) -> dict[str, Any]:
    """A :class:`PhaseCost` as a plain dict (for ``--json``)."""
    return asdict(cost)
