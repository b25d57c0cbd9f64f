"""What the cluster-scale model assumes: the stores' documented rates and its constants.

:func:`assumptions` states every one of them, one line each, as ``jaxckpt plan
--processes`` prints them under its table. Pure: no jax, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jaxckpt.planning._profiles import (
    METRICS,
    PHASES,
    RETRY_BUDGET_BEFORE_S,
    RETRY_DEADLINE_S,
    ROLES,
    Profile,
)

if TYPE_CHECKING:
    from jaxckpt.formats import DataFormat

__all__ = ["STORES", "Store", "assumptions", "default_format"]

RECORD_BYTES = 68
"""Bytes of one chunk record in a manifest part (measured: 1.2 MB for 17,600 records)."""
PARSE_BYTES_PER_S = 50e6
"""JSON records parsed and checked per second by one process (an assumption)."""
COORD_CALL_S = 1e-3
"""One blocking coordination-service call across a cluster network (an assumption; 0.41 ms
was measured on loopback)."""
COORD_CALLS_PER_S = 10_000.0
"""Calls per second the coordination service answers (8,300 gets/s measured on loopback
from 8 threads on a 2-core machine)."""


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


def default_format() -> DataFormat:
    """The data format new steps are written in by default (``CheckpointOptions.layout``)."""
    from jaxckpt._options import CheckpointOptions
    from jaxckpt.formats import format_named

    return format_named(CheckpointOptions().layout)


def assumptions(
    profile: Profile,
    *,
    prefixes: int,
    link: Any,
    state_bytes: float,
    leaves: int,
    dpp: int,
    data_format: DataFormat | None = None,
) -> list[str]:
    """Every assumption of :func:`jaxckpt.planning._scale.scale_plan`, one line each (printed
    with its table); ``data_format`` as there."""
    name = (default_format() if data_format is None else data_format).name
    lines = [
        f"state: {state_bytes / 1e9:,.0f} GB (70B parameters with Adam: ~16 B each), "
        f"{leaves:,} leaves, each sharded over all devices, {dpp} devices per process, "
        f"{name} layout (jaxckpt.planning._costs.process_share)",
        f"counts per process: profile {profile.name!r}: {profile.source}",
        f"data requests and their floor: the {name} layout's (jaxckpt.planning._floors), "
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
        "the throttled wait exceeds the profile's retry budget (before: "
        f"~{RETRY_BUDGET_BEFORE_S:g} s, 6 attempts of 0.5-8 s; now: the deadline, "
        f"{RETRY_DEADLINE_S:g} s by default)"
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
