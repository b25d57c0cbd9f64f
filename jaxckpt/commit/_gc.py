"""What lies under a root besides committed steps, and garbage collection of it.

Shared by the manager (on every writable open), ``jaxckpt ls`` and ``jaxckpt gc``.

* **partial**: an attempt with a pending record and no valid marker naming it
  (a save under way, or one that died).
* **orphaned**: attempt data with neither a pending record nor a marker (a
  marker deleted by hand); found only by a full scan, which lists all data.
* **hidden**: a valid marker of an older epoch that a newer epoch does not
  know: a fenced writer committed after the takeover. Never listed.
* **damaged**: a visible marker that does not parse or fails its checksum.
  Create-only writes are atomic on every backend, so a crash cannot produce
  one: it is corruption, reported and kept (removed only with ``force``).

Collection removes partial and orphaned attempts of *fenced* epochs (older
than the newest) and those older than the grace period, hidden steps, and
stale pending records of committed attempts. A live writer's attempt (newest
epoch, younger than the grace period) is never touched. Imports no jax.

Ages are judged by the storage's own clock, never by the operator's: a
partial attempt's age is that of its pending record as the store reports it
(:meth:`jaxckpt.storage.Storage.age`: a file's mtime against a probe file's,
an object's modification time against the ``Date`` of the same response), so
``jaxckpt gc`` on a host whose clock is hours off keeps a live save. Only
where the store cannot tell (an object store without a direct reader) does
the age fall back to the ``started`` time the writer recorded, against this
host's clock.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

from jaxckpt.commit._fence import Epochs
from jaxckpt.commit._partcheck import incomplete_steps
from jaxckpt.commit._protocol import CommitProtocol
from jaxckpt.errors import CheckpointError, StorageError
from jaxckpt.records import (
    ATTEMPTS,
    COMMITS,
    DATA,
    LEGACY_STEPS,
    PENDING,
    TEMP_GRACE_S,
    WRITERS,
    CommitMarker,
    MarkerRef,
    StepLocation,
    is_latest_hint,
    is_stale_temp_key,
    is_temp_key,
    latest_hint_key,
    load_json_record,
    marker_refs_of,
    parse_attempt,
    parse_data_key,
    parse_pending_key,
)
from jaxckpt.storage import Storage

log = logging.getLogger("jaxckpt")


@dataclass(frozen=True, kw_only=True)
class Attempt:
    """An attempt (or format-1 step) with data or a pending record but no marker."""

    location: StepLocation
    kind: str  # "partial", "orphaned", or "damaged" (data of a step whose marker is damaged)
    operation: str | None = None
    started: float | None = None
    written_ago: float | None = None
    """Seconds since the pending record was written, by the storage's clock (None: unknown)."""

    @property
    def step(self) -> int:
        return self.location.step

    def age(self, now: float) -> float | None:
        """Seconds since the attempt began: by the storage's clock when known, else
        the writer's recorded start (or the attempt name's time) against ``now``."""
        if self.written_ago is not None:
            return self.written_ago
        started = self.started
        if started is None and self.location.attempt:
            parsed = parse_attempt(self.location.attempt)
            started = parsed[1] if parsed else None
        return None if started is None else now - started


@dataclass(frozen=True, kw_only=True)
class RootScan:
    """Everything under a root at one moment, classified."""

    epochs: Epochs
    committed: dict[int, CommitMarker]
    damaged: dict[int, MarkerRef]
    hidden: list[CommitMarker]
    attempts: list[Attempt]
    stale_pending: list[str]
    temp_keys: list[str]
    full: bool
    named: set[StepLocation] = field(default_factory=set)
    incomplete: dict[int, str] = field(default_factory=dict)
    """``full`` only: committed steps whose stored manifest parts are fewer than their
    marker covers (damaged; their data is kept), with what is missing."""


def scan(
    protocol: CommitProtocol,
    *,
    full: bool,
    commit_keys: list[str] | None = None,
    temp_grace_s: float = TEMP_GRACE_S,
) -> RootScan:
    """Classifies what is under the root.

    Without ``full`` it reads only ``pending/``, ``commits/`` and ``writers/``
    listings and the markers of steps with a pending record or a hidden
    marker (cheap enough for every writable open); ``full`` also reads every
    visible marker (to find damaged ones) and lists all data (orphans).
    ``commit_keys``: a listing of ``commits/`` just taken (None: one is taken).
    """
    storage = protocol.storage
    data_keys = [k for p in (ATTEMPTS, DATA, LEGACY_STEPS) for k in storage.list(p)] if full else []
    pending_keys = storage.list(PENDING)
    commit_keys = storage.list(COMMITS) if commit_keys is None else commit_keys
    refs = marker_refs_of(commit_keys)
    epochs = protocol.epochs.load()
    visible = protocol.visible_refs(epochs, refs)
    pending = {loc: key for key in pending_keys if (loc := parse_pending_key(key))}
    to_read = [r for r in refs if not epochs.visible(r)]
    if full:
        to_read += list(visible.values())
    else:
        steps = {loc.step for loc in pending}
        to_read += [visible[s] for s in steps if s in visible]
    markers = dict(zip(to_read, protocol.map(protocol.read_ref, to_read), strict=True))
    committed = {
        r.step: m for r, m in markers.items() if m is not None and visible.get(r.step) == r
    }
    damaged = {r.step: r for r, m in markers.items() if m is None and visible.get(r.step) == r}
    hidden = [m for r, m in markers.items() if m is not None and not epochs.visible(r)]
    named = {m.location for m in committed.values()}
    attempts, stale = [], []
    unnamed = []
    for loc, key in sorted(pending.items(), key=lambda kv: kv[1]):
        if loc in named:
            stale.append(key)
        else:
            unnamed.append((loc, key))
    infos = protocol.map(lambda item: _pending_info(protocol, item[1]), unnamed)
    for (loc, _), (operation, started, written_ago) in zip(unnamed, infos, strict=True):
        attempts.append(
            Attempt(
                location=loc,
                kind="partial",
                operation=operation,
                started=started,
                written_ago=written_ago,
            )
        )
    seen = set(pending) | named | {m.location for m in hidden}
    for loc in sorted({loc for k in data_keys if (loc := parse_data_key(k))}, key=str):
        if loc not in seen:
            kind = "damaged" if loc.step in damaged else "orphaned"
            attempts.append(Attempt(location=loc, kind=kind))
    keys = pending_keys + commit_keys + storage.list(WRITERS)
    temp = [k for k in keys if is_temp_key(k) and _stale_temp(storage, k, temp_grace_s)]
    # Hints of fenced epochs: only the newest epoch's hint is ever read.
    newest_hint = latest_hint_key(epochs.newest)
    temp += [k for k in commit_keys if is_latest_hint(k) and k != newest_hint]
    return RootScan(
        epochs=epochs,
        committed=committed,
        damaged=damaged,
        hidden=hidden,
        attempts=attempts,
        stale_pending=stale,
        temp_keys=temp,
        full=full,
        named=named,
        incomplete=incomplete_steps(storage, committed, data_keys) if full else {},
    )


def _stale_temp(storage: Storage, key: str, grace_s: float) -> bool:
    """A temp file old enough, by the storage's clock, to be a crashed write's."""
    if is_stale_temp_key(key, -math.inf):
        return True  # no time in its name: no live writer made it (they stamp theirs)
    age = _written_ago(storage, key)
    if age is None:
        return is_stale_temp_key(key, time.time(), grace_s)  # not a concurrent writer's
    return age >= grace_s


def _written_ago(storage: Storage, key: str) -> float | None:
    try:
        return storage.age(key)
    except StorageError as e:
        log.debug("cannot tell the age of %s by the storage's clock: %s", key, e)
        return None


def _pending_info(
    protocol: CommitProtocol, key: str
) -> tuple[str | None, float | None, float | None]:
    """``(operation, started, written_ago)`` of a pending record (Nones where unknown)."""
    raw = protocol.storage.read(key)
    if raw is None:
        return None, None, None
    written_ago = _written_ago(protocol.storage, key)
    try:
        record = load_json_record(raw, protocol.where(key))
    except CheckpointError:
        return None, None, written_ago
    return record.get("operation"), record.get("started"), written_ago


def is_live(attempt: Attempt, current_epoch: int, grace_s: float, now: float) -> bool:
    """A writer may still be working on it: newest epoch and younger than the grace period."""
    if attempt.operation == "delete":
        return False  # a delete whose marker is gone: finishing it is always right
    if attempt.location.epoch < current_epoch:
        return False
    age = attempt.age(now)
    return age is not None and age < grace_s


def collect(
    protocol: CommitProtocol,
    found: RootScan,
    *,
    grace_s: float,
    force: bool = False,
) -> list[StepLocation]:
    """Removes what ``found`` shows is garbage; returns the attempts removed.

    Args:
      grace_s: attempts of the newest epoch younger than this are live and kept.
      force: also remove damaged markers and every unnamed attempt of their steps.
    """
    now = time.time()
    current = max(found.epochs.newest, protocol.epoch or 0)
    removed: list[StepLocation] = []
    for marker in found.hidden:
        log.info(
            "removing %s of fenced writer epoch %d (committed after a takeover)",
            marker.location,
            marker.epoch,
        )
        protocol.retract(marker.location, marker.key)
        removed.append(marker.location)
    if force:  # first, so that the attempts below are no longer named by them
        for step, ref in found.damaged.items():
            log.warning("removing the damaged commit marker of step %d (--force)", step)
            protocol.storage.delete(ref.key)
    for attempt in found.attempts:
        if attempt.step in found.damaged and not force:
            continue
        if is_live(attempt, current, grace_s, now):
            continue
        try:
            if not protocol.abandon(attempt.location):
                continue  # committed since the scan, or refilled while removed (kept)
        except StorageError as e:
            # A fenced writer may still be writing into it (a directory that
            # refills while it is removed); what is left is collected next time.
            log.warning("could not remove %s yet: %s", attempt.location, e)
            continue
        removed.append(attempt.location)
    protocol.storage.delete_many(found.stale_pending + found.temp_keys)
    if removed:
        log.info("removed %s under %s", ", ".join(map(str, removed)), protocol.storage.uri)
    return removed
