"""Reading a root's run ledger back: every run's events, per process, checked."""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from jaxckpt.errors import CheckpointError
from jaxckpt.ledger._events import LEDGER, LedgerObject, parse_key
from jaxckpt.storage import Storage

log = logging.getLogger("jaxckpt")

MAX_OBJECTS = 1_000_000
"""The most ledger objects a report reads (a week at one object per 10 s is 60,480)."""


@dataclass(frozen=True, kw_only=True)
class RunEvents:
    """One run of the job (one writer epoch): its processes' events.

    Attributes:
      epoch: the run's writer epoch.
      processes: the job's process count.
      events: per process index, its events in the order they were recorded.
      objects: ledger objects read for this run.
      skipped: objects that were not valid ledger objects, and events that were not
        valid events (both ignored).
    """

    epoch: int
    processes: int
    events: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    objects: int = 0
    skipped: int = 0

    def of(self, kind: str, process: int | None = None) -> list[dict[str, Any]]:
        """Events of ``kind`` (of one process, or of all), in time order."""
        chosen = self.events.values() if process is None else [self.events.get(process, [])]
        return sorted((e for es in chosen for e in es if e["kind"] == kind), key=lambda e: e["t"])

    def times(self) -> list[float]:
        return [e["t"] for es in self.events.values() for e in es]


def read_ledger(storage: Storage) -> list[RunEvents]:
    """Every run recorded under ``storage``'s ``ledger/``, oldest first.

    Keys that are not ledger keys, and objects that are oversized or malformed, are
    skipped (counted in :attr:`RunEvents.skipped`, logged once).

    Raises:
      StorageError: the store failed.
      CheckpointError: more than :data:`MAX_OBJECTS` ledger objects.
    """
    keys = storage.list(LEDGER)
    if len(keys) > MAX_OBJECTS:
        raise CheckpointError(
            f"{storage.uri}/{LEDGER} holds {len(keys):,} objects, more than a report reads "
            f"({MAX_OBJECTS:,})"
        )
    parsed = sorted((p, k) for k in keys if (p := parse_key(k)) is not None)
    skipped: dict[int, int] = defaultdict(int)
    objects: dict[int, list[LedgerObject]] = defaultdict(list)
    for (epoch, _, _), key in parsed:
        data = storage.read(key)
        obj = None if data is None else LedgerObject.from_bytes(key, data)
        if obj is None:
            skipped[epoch] += 1
            log.warning("ledger: %s/%s is not a valid ledger object; skipped", storage.uri, key)
            continue
        objects[epoch].append(obj)
        skipped[epoch] += obj.dropped
    runs = []
    for epoch in sorted(objects):
        events: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for obj in objects[epoch]:  # sorted by process, then sequence
            events[obj.process].extend(obj.events)
        runs.append(
            RunEvents(
                epoch=epoch,
                processes=max(o.processes for o in objects[epoch]),
                events=dict(events),
                objects=len(objects[epoch]),
                skipped=skipped[epoch],
            )
        )
    return runs
