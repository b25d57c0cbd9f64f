"""A tier: one root a manager saves to or restores from, with everything that reads and writes it.

A :class:`Tier` bundles a root's storage, its commit protocol, the TensorStore
context, the array writer, the step reader and the retention rule that
applies there. A plain manager holds one tier (``"durable"``, the job's shared
root); a tiered manager holds two, nearest first: ``"local"`` (each host's own
root) and ``"durable"``. Everything else (the save session, the restore
selection, retention, promotion) works on tiers and never builds this bundle
itself; :func:`open_tier` is the one place that does.

A tier is either *own* (each host is the only writer of its own root and
lists it itself) or *shared* (one root for the whole job: the primary takes
its epoch and lists it for everyone).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterable, Sequence
from typing import Protocol

import jax
import tensorstore as ts

from jaxckpt import _gc, _owner, policy
from jaxckpt._agree import Agreement
from jaxckpt._commit import CommitProtocol
from jaxckpt._fence import EpochReader
from jaxckpt._keys import (
    COMMITS,
    REPLICAS,
    ROOT_RECORD,
    MarkerRef,
    StepLocation,
    parse_replica_step,
    replica_prefix,
)
from jaxckpt._options import CheckpointOptions
from jaxckpt._records import CommitMarker
from jaxckpt._restore import StepReader
from jaxckpt._tsio import ArrayWriter
from jaxckpt.errors import CheckpointError, LocalRootInUseError, NotACheckpointRootError
from jaxckpt.storage import Storage, open_storage, tensorstore_backed

log = logging.getLogger("jaxckpt")

TIER_NAMES = ("local", "durable")


class Replicas(Protocol):
    """A local tier's copies on other nodes (``local_replicas``; see ``_peertier``)."""

    def replicate(
        self,
        loc: StepLocation,
        *,
        metrics: dict[str, float] | None,
        keep: bool,
        request: bytes | None = None,
    ) -> None:
        """Sends this process's part of ``loc`` to its holders (before its local marker)."""

    def heal(self, step: int | None) -> None:
        """Brings back, before a restore, a step whose parts are spread over the peers."""

    def close(self) -> None:
        """Stops serving this process's replicas."""


class NoReplicas:
    """The replicas of a tier that has none (``local_replicas=1``, a durable tier)."""

    def replicate(
        self,
        loc: StepLocation,
        *,
        metrics: dict[str, float] | None,
        keep: bool,
        request: bytes | None = None,
    ) -> None:
        return None

    def heal(self, step: int | None) -> None:
        return None

    def close(self) -> None:
        return None


class Tier:
    """One root and its storage → protocol → context → writer → reader bundle.

    Args:
      name: ``"local"`` (an own root per host) or ``"durable"`` (shared by the job).
      storage: the opened root.
      options: the manager's options (in-flight bytes; the tier's retention rule).
    """

    def __init__(self, name: str, storage: Storage, options: CheckpointOptions) -> None:
        if name not in TIER_NAMES:
            raise ValueError(f"tier name must be one of {TIER_NAMES}, got {name!r}")
        self.name = name
        self.own = name == "local"
        self.storage = storage
        self.protocol = CommitProtocol(storage)
        self.context = ts.Context(tensorstore_backed(storage).context_spec())
        self.arrays = ArrayWriter(
            storage, self.context, max_inflight_bytes=options.max_inflight_bytes
        )
        self.reader = StepReader(
            self.protocol, self.arrays, self.context, reads_in_flight=options.objects_in_flight
        )
        self.retention: policy.RetentionPolicy | None = (
            options.local_retention if self.own else options.retention
        )
        self.replicated = self.own and options.local_replicas > 1
        """Holds other processes' replicas under ``replicas/`` (see ``_peertier``)."""
        self.peers: Replicas = NoReplicas()
        """Where this own tier's parts are replicated (set by ``_peertier.join_tiers``)."""

    def __repr__(self) -> str:
        return f"Tier({self.name!r}, {self.uri!r})"

    @property
    def uri(self) -> str:
        return self.storage.uri

    # -- reading ---------------------------------------------------------------

    def committed(self) -> dict[int, CommitMarker]:
        """Every visible committed step with its validated marker (one GET per step)."""
        return self.protocol.committed()

    def visible(self) -> list[int]:
        """Steps whose marker is visible, ascending (listings only, no marker read)."""
        return sorted(self.protocol.visible_refs())

    def refs(self) -> dict[int, MarkerRef]:
        """Each visible step's marker key (listings only, no marker read)."""
        return self.protocol.visible_refs()

    def marker(self, step: int, ref: MarkerRef | None = None) -> CommitMarker:
        """The marker of the committed ``step``: one GET when ``ref`` is from a listing
        just taken (a marker gone since is a deleted step); else through a fresh listing.

        Raises:
          StepNotFoundError / UncommittedStepError / CorruptCheckpointError: no valid
            committed ``step`` (see ``CommitProtocol.require_marker``).
        """
        return self.protocol.require_marker(step, ref)

    def latest(self) -> CommitMarker | None:
        """The newest valid marker (usually one marker GET; see ``CommitProtocol.latest``)."""
        return self.protocol.latest()

    def holds(self, step: int) -> bool:
        """Whether ``step`` has a visible marker here (a listing, no marker read)."""
        return step in self.protocol.visible_refs()

    def everywhere(self, agreement: Agreement, steps: Iterable[int]) -> set[int]:
        """Of ``steps`` (this host's), those every host has here (collective on an own tier)."""
        common = set(steps)
        if not self.own:
            return common
        for other in agreement.gather(f"{self.name}-steps", sorted(common)):
            common &= set(other)
        return common

    def newest(self, agreement: Agreement, *, primary: bool) -> int | None:
        """The newest step restorable from this tier on every host (this host's answer).

        A shared tier is read by the primary only, an own tier by every host; one
        process reads one marker (:meth:`latest`).
        """
        if self.own and jax.process_count() > 1:
            return max(self.everywhere(agreement, self.committed()), default=None)
        marker = self.latest() if self.own or primary else None
        return None if marker is None else marker.step

    # -- writing ---------------------------------------------------------------

    def ensure(self, *, create: bool) -> None:
        """Checks (with ``create``: writes) the root record."""
        self.protocol.ensure_root(create=create)

    def take_epoch(
        self,
        agreement: Agreement,
        *,
        primary: bool,
        gc_grace_s: float | None,
        serves: str | None = None,
    ) -> int:
        """Becomes this root's writer: an own tier on every host, a shared one by the
        primary, whose epoch every host then writes in (collective on a shared tier).

        Args:
          gc_grace_s: collect the root's garbage after taking the epoch; None: do not.
          serves: an own tier: the durable root's URI, recorded (or checked) first.

        Raises:
          LocalRootInUseError: ``serves`` is not the durable root this root serves.
        """
        epoch = None
        if self.own or primary:
            self.ensure(create=True)
            if serves is not None:
                _owner.claim(self.storage, serves)
            keys = self.storage.list(COMMITS)  # the one listing of commits/ an open takes
            epoch = self.protocol.take_epoch(keys).epoch
            if gc_grace_s is not None:
                self.collect(gc_grace_s, keys)
        if not self.own:
            epoch = agreement.agree(f"{self.name}-epoch", epoch)
        assert epoch is not None
        self.protocol.epoch = epoch
        return epoch

    def revive(self, serves: str | None) -> bool:
        """Recreates an own tier wiped under its running writer; True if it was.

        A local root removed while the job trains (its root record gone) is
        written again: the root record, the durable root it serves and a new
        writer epoch (the old epoch record went with it). One read when intact.

        Raises:
          LocalRootInUseError: another job recreated it for its own durable root.
        """
        if not self.own or self.storage.read(ROOT_RECORD) is not None:
            return False
        log.warning(
            "local root %s was removed under this job (no %s): recreating it",
            self.uri,
            ROOT_RECORD,
        )
        self.ensure(create=True)
        if serves is not None:
            _owner.claim(self.storage, serves)
        self.protocol.epochs = EpochReader(self.storage)  # the cached records went too
        self.protocol.take_epoch()
        return True

    def collect(self, grace_s: float, commit_keys: list[str] | None = None) -> None:
        """Removes fenced and stale attempts; a failure leaves them for the next writer.

        Args:
          commit_keys: a listing of ``commits/`` just taken (None: list it).
        """
        try:
            found = _gc.scan(self.protocol, full=False, commit_keys=commit_keys)
            _gc.collect(self.protocol, found, grace_s=grace_s)
            self.collect_replicas()
        except CheckpointError as e:
            log.warning("garbage collection on open of %s failed (retried later): %s", self.uri, e)

    def garbage_collect(self, grace_s: float, *, force: bool = False) -> list[int]:
        """Removes partial, orphaned and fenced attempts (a full scan); returns their steps.

        Raises:
          WriterFencedError: a newer writer took over the root.
        """
        self.protocol.check_fence("collect garbage")
        temp_grace = min(grace_s, _gc.TEMP_GRACE_S)  # a shorter grace covers temp files too
        found = _gc.scan(self.protocol, full=True, temp_grace_s=temp_grace)
        removed = _gc.collect(self.protocol, found, grace_s=grace_s, force=force)
        return sorted({loc.step for loc in removed} | set(self.collect_replicas()))

    def collect_replicas(self) -> list[int]:
        """Removes the replicas of steps older than this tier's newest step that it does
        not hold itself (their save failed here, or retention deleted them before the
        replicas came); returns their steps. A replica of a newer step may be in flight."""
        if not self.replicated:
            return []
        steps = {s for k in self.storage.list(REPLICAS) if (s := parse_replica_step(k)) is not None}
        own = set(self.visible())
        stale = sorted(s for s in steps - own if s < max(own, default=-1))
        for step in stale:
            log.info("removing replicas of step %d under %s (not held here)", step, self.uri)
            self.storage.delete_prefix(replica_prefix(step))
        return stale

    def delete(self, step: int) -> None:
        """Deletes a committed step here (marker first, fence-checked), with the
        replicas of other processes' parts of it this tier holds."""
        self.protocol.delete(step)
        if self.replicated:
            self.storage.delete_prefix(replica_prefix(step))


def open_tier(uri: str | os.PathLike[str], options: CheckpointOptions, name: str) -> Tier:
    """Opens the root ``uri`` as the tier ``name`` (writes nothing).

    Raises:
      ValueError / CheckpointError: ``uri`` is not a root the storage layer accepts.
    """
    root = os.fspath(uri)
    return Tier(name, open_storage(root, **options.storage_kwargs(root)), options)


def reading_tier(storage: Storage) -> Tier:
    """``storage`` as a tier to read outside a manager (``open_step``, the CLI)."""
    return Tier("durable", storage, CheckpointOptions())


def open_tiers(root: str | os.PathLike[str], options: CheckpointOptions) -> tuple[Tier, ...]:
    """The manager's tiers, nearest first: ``(durable,)``, or ``(local, durable)`` with
    ``options.local_root``. Every root is opened (and so validated) before any is written.

    Raises:
      CheckpointError: ``local_root`` and ``root`` are the same root.
    """
    durable = open_tier(root, options, "durable")
    if options.local_root is None:
        return (durable,)
    local = open_tier(options.local_root, options, "local")
    if local.uri == durable.uri:
        raise CheckpointError(f"local_root and root are the same root: {durable.uri}")
    return (local, durable)


def take_epochs(tiers: Sequence[Tier], agreement: Agreement, options: CheckpointOptions) -> None:
    """Opens ``tiers`` as the manager's ``options`` say (collective): read-only, each
    root must exist; else each is written and its epoch taken, nearest first."""
    serves = tiers[-1].uri  # what every own tier must serve (see _owner)
    require_served(agreement, tiers, serves)
    if options.read_only:
        for tier in tiers:
            try:
                tier.ensure(create=False)
            except NotACheckpointRootError:
                if not tier.own:
                    raise
                log.warning(  # the durable root is the job's checkpoint; this is a cache
                    "local root %s has no steps (not created yet, or removed): reading %s only",
                    tier.uri,
                    serves,
                )
        return
    require_own_roots(agreement, tiers)
    primary = jax.process_index() == options.primary_host
    grace = options.gc_grace_s if options.gc_on_open else None
    for tier in tiers:
        own = serves if tier.own else None
        tier.take_epoch(agreement, primary=primary, gc_grace_s=grace, serves=own)


def require_served(agreement: Agreement, tiers: Iterable[Tier], durable: str) -> None:
    """Refuses an own tier that serves another durable root than ``durable`` (collective:
    every host raises if any host's local root is another job's; reads one record each).

    Raises:
      LocalRootInUseError: a local root records another durable root.
    """
    reasons = [r for t in tiers if t.own and (r := _owner.refusal(t.storage, durable))]
    reason = reasons[0] if reasons else None
    if jax.process_count() > 1:
        reason = next((r for r in agreement.gather("local-served", reason) if r), None)
    if reason is not None:
        raise LocalRootInUseError(reason)


def require_own_roots(agreement: Agreement, tiers: Iterable[Tier]) -> None:
    """Refuses an own tier that two processes of this job on one machine would share
    (collective; nothing is written before it passes).

    Every host is the only writer of its local root: two processes on one
    machine given the same ``local_root`` (say, one process per GPU with
    ``local_root="/mnt/nvme/run1"``) would fence each other's epochs there.
    A path on storage that several machines mount is not detected.

    Raises:
      CheckpointError: two processes have the same host name and local root.
    """
    if jax.process_count() == 1:
        return
    for tier in tiers:
        if not tier.own:
            continue
        uri = tier.uri
        path = uri if "://" in uri else os.path.realpath(uri)
        first: dict[tuple[str, str], int] = {}
        for process, (host, where) in enumerate(
            agreement.gather("local-roots", [socket.gethostname(), path])
        ):
            other = first.setdefault((host, where), process)
            if other != process:
                raise CheckpointError(
                    f"local_root {where!r} on host {host}: processes {other} and {process} of "
                    "this job share it; each process needs a local tier of its own, e.g. "
                    f'local_root=f"{where}/{{jax.process_index()}}"'
                )
