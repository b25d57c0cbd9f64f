"""The two kinds of tier (see :mod:`jaxckpt.tiers._tier`): :class:`OwnTier`, a root of
each host's own, and :class:`SharedTier`, the job's one root, on their shared base.

What differs between them is behaviour of the kind (who takes the epoch, who lists and
prunes, which steps a host may read, which checks a root must pass, where a save
commits), never a branch on the kind elsewhere.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, ClassVar

import jax
import tensorstore as ts

from jaxckpt import policy
from jaxckpt._options import CheckpointOptions
from jaxckpt.commit import Agreement, CommitProtocol, EpochReader, collect, scan
from jaxckpt.errors import CheckpointError, LocalRootInUseError, NotACheckpointRootError
from jaxckpt.formats import ArrayWriter
from jaxckpt.records import (
    COMMITS,
    ROOT_RECORD,
    TEMP_GRACE_S,
    CommitMarker,
    MarkerRef,
    claim,
    refusal,
)
from jaxckpt.storage import Storage, tensorstore_backed
from jaxckpt.tiers._commitpoint import EVERY_HOST, ONCE_FOR_THE_JOB, CommitPoint
from jaxckpt.tiers._durablejoin import JoinedLater
from jaxckpt.tiers._peers import NoReplicas, Replicas, open_replicas

if TYPE_CHECKING:
    from jaxckpt.tiers._tier import Listed

__all__ = ["OwnTier", "SharedTier"]

log = logging.getLogger("jaxckpt")


class _Root:
    """What both kinds share: the bundle, reading, garbage collection and deletion.

    Args:
      storage: the opened root.
      options: the manager's options (in-flight bytes, objects in flight).
    """

    name: ClassVar[str]
    own: ClassVar[bool]
    commit_point: ClassVar[CommitPoint]
    retention: policy.RetentionPolicy | None
    peers: Replicas

    def __init__(self, storage: Storage, options: CheckpointOptions) -> None:
        self.storage = storage
        self.protocol = CommitProtocol(storage)
        self.context = ts.Context(tensorstore_backed(storage).context_spec())
        self.arrays = ArrayWriter(
            storage, self.context, max_inflight_bytes=options.max_inflight_bytes
        )
        self.reads_in_flight = options.objects_in_flight

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

    # -- writing ---------------------------------------------------------------

    def ensure(self, *, create: bool) -> None:
        """Checks (with ``create``: writes) the root record."""
        self.protocol.ensure_root(create=create)

    def _take(self, gc_grace_s: float | None, serves: str | None) -> int:
        """Writes the root record (and the durable root it serves), takes a new epoch and,
        with ``gc_grace_s``, collects garbage: this host's part of taking the epoch."""
        self.ensure(create=True)
        if serves is not None:
            claim(self.storage, serves)
        keys = self.storage.list(COMMITS)  # the one listing of commits/ an open takes
        epoch = self.protocol.take_epoch(keys).epoch
        if gc_grace_s is not None:
            self.collect(gc_grace_s, keys)
        return epoch

    def collect(self, grace_s: float, commit_keys: list[str] | None = None) -> None:
        """Removes fenced and stale attempts and replicas; a failure leaves them to the next writer.

        Args:
          commit_keys: a listing of ``commits/`` just taken (None: list it).
        """
        try:
            found = scan(self.protocol, full=False, commit_keys=commit_keys)
            collect(self.protocol, found, grace_s=grace_s)
            self.peers.collect()
        except CheckpointError as e:
            log.warning("garbage collection on open of %s failed (retried later): %s", self.uri, e)

    def garbage_collect(self, grace_s: float, *, force: bool = False) -> list[int]:
        """Removes partial, orphaned and fenced attempts (a full scan) and stale replicas;
        returns their steps.

        Raises:
          WriterFencedError: a newer writer took over the root.
        """
        self.protocol.check_fence("collect garbage")
        temp_grace = min(grace_s, TEMP_GRACE_S)  # a shorter grace covers temp files too
        found = scan(self.protocol, full=True, temp_grace_s=temp_grace)
        removed = collect(self.protocol, found, grace_s=grace_s, force=force)
        return sorted({loc.step for loc in removed} | set(self.peers.collect()))

    def delete(self, step: int) -> None:
        """Deletes a committed step here (marker first, fence-checked), with the
        replicas of other processes' parts of it this tier holds."""
        self.protocol.delete(step)
        self.peers.delete(step)

    # -- joined in the background (a shared tier behind a local one; see SharedTier) --

    deferred = False
    """The open went on without this root's epoch (never for an own root)."""

    def answers(self) -> bool:
        return True

    def learned(self) -> int | None:
        return None

    def catch_up(self, agreement: Agreement, *, closing: bool = False) -> None:
        pass

    def adopt(self, epoch: int) -> None:
        self.protocol.epoch = epoch

    def on_adopt(self, told: Callable[[int], None]) -> None:
        if self.protocol.epoch is not None:
            told(self.protocol.epoch)

    def stop_joining(self) -> None:
        pass

    def begin_join(self, *, gc_grace_s: float | None) -> None:
        pass


class OwnTier(_Root):
    """A root of this host's own (``local_root``): every host writes, lists and
    collects its own, and its parts may be replicated on other nodes (``peers``,
    decided once here by :func:`~jaxckpt.tiers._peers.open_replicas`)."""

    name = "local"
    own = True
    commit_point = EVERY_HOST

    def __init__(self, storage: Storage, options: CheckpointOptions) -> None:
        super().__init__(storage, options)
        self.retention = options.local_retention
        self.peers = open_replicas(self, options)

    def everywhere(self, agreement: Agreement, steps: Iterable[int]) -> set[int]:
        """Of ``steps`` (this host's), those every host has here (collective)."""
        common = set(steps)
        for other in agreement.gather(f"{self.name}-steps", sorted(common)):
            common &= set(other)
        return common

    def newest(self, agreement: Agreement, *, primary: bool, wait: bool = True) -> int | None:
        """The newest step restorable from this tier on every host (this host's answer;
        one marker read on one process, every host's listing on several)."""
        if jax.process_count() > 1:  # what every host has, or healing would bring back
            steps = [*self.everywhere(agreement, self.committed()), self.peers.complete()]
            return max((s for s in steps if s is not None), default=None)
        marker = self.latest()
        return None if marker is None else marker.step

    def readable(
        self, agreement: Agreement, listed: Listed, *, primary: bool, wait: bool = True
    ) -> tuple[dict[int, MarkerRef | None], set[int]]:
        """The steps this host may read here (what its own root lists, with their marker
        keys), and those of them every host has (collective on several processes)."""
        mine: dict[int, MarkerRef | None] = dict(listed(self))
        return mine, self.everywhere(agreement, mine)

    def open_read_only(self, serves: str) -> None:
        """Checks the root record; a root not there is a cache to skip, said in the log."""
        try:
            self.ensure(create=False)
        except NotACheckpointRootError:
            log.warning(  # the durable root is the job's checkpoint; this is a cache
                "local root %s has no steps (not created yet, or removed): reading %s only",
                self.uri,
                serves,
            )

    def refusal(self, durable: str) -> str | None:
        """Why this root cannot serve the ``durable`` root (another job's), or None."""
        return refusal(self.storage, durable)

    def take_epoch(
        self,
        agreement: Agreement,
        *,
        primary: bool,
        gc_grace_s: float | None,
        serves: str | None = None,
        wait_s: float | None = None,
    ) -> int:
        """Becomes this root's writer on this host (every host does, for its own root):
        records (or checks) the durable root it ``serves`` first, and with ``gc_grace_s``
        collects garbage after.

        Raises:
          LocalRootInUseError: ``serves`` is not the durable root this root serves.
        """
        self.protocol.epoch = epoch = self._take(gc_grace_s, serves)
        return epoch

    def revive(self, serves: str | None) -> bool:
        """Recreates this root wiped under its running writer; True if it was.

        A local root removed while the job trains (its root record gone) is
        written again: the root record, the durable root it serves and a new
        writer epoch (the old epoch record went with it). One read when intact.

        Raises:
          LocalRootInUseError: another job recreated it for its own durable root.
        """
        if self.storage.read(ROOT_RECORD) is not None:
            return False
        log.warning(
            "local root %s was removed under this job (no %s): recreating it",
            self.uri,
            ROOT_RECORD,
        )
        self.ensure(create=True)
        if serves is not None:
            claim(self.storage, serves)
        self.protocol.epochs = EpochReader(self.storage)  # the cached records went too
        self.protocol.take_epoch()
        return True

    def check_served(self, agreement: Agreement, durable: str) -> None:
        """Refuses this root if it serves another durable root than ``durable`` (collective:
        every host raises if any host's local root is another job's; one record read).

        Raises:
          LocalRootInUseError: a local root records another durable root.
        """
        reason = self.refusal(durable)
        if jax.process_count() > 1:
            reported = agreement.reports(f"{self.name}-served", reason)
            reason = reported[min(reported)] if reported else None
        if reason is not None:
            raise LocalRootInUseError(reason)

    def check_alone(self, agreement: Agreement) -> None:
        """Refuses this root if two processes of this job on one machine would share it
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
        uri = self.uri
        path = uri if "://" in uri else os.path.realpath(uri)
        first: dict[tuple[str, str], int] = {}
        for process, (host, where) in enumerate(
            agreement.gather(f"{self.name}-roots", [socket.gethostname(), path])
        ):
            other = first.setdefault((host, where), process)
            if other != process:
                raise CheckpointError(
                    f"local_root {where!r} on host {host}: processes {other} and {process} of "
                    "this job share it; each process needs a local tier of its own, e.g. "
                    f'local_root=f"{where}/{{jax.process_index()}}"'
                )

    def prunes(self, *, primary: bool) -> bool:
        """True: every host applies retention to its own root."""
        return True


class SharedTier(JoinedLater, _Root):
    """The job's one root (``root``): the primary writes its records and lists it for
    every host; every host writes its parts in the primary's epoch.

    Behind a local tier it is joined in the background when it does not answer within
    ``durable_wait_s`` (see :mod:`jaxckpt.tiers._durablejoin`): until every host has
    :meth:`adopt`-ed the epoch, :attr:`deferred` is true and the primary reads it only
    once it :meth:`answers` (or when nothing else holds a step: ``wait``)."""

    name = "durable"
    own = False
    commit_point = ONCE_FOR_THE_JOB

    def __init__(self, storage: Storage, options: CheckpointOptions) -> None:
        super().__init__(storage, options)
        self.retention = options.retention
        self.peers = NoReplicas()
        self.join_later(options.save_timeout_s)

    def everywhere(self, agreement: Agreement, steps: Iterable[int]) -> set[int]:
        return set(steps)  # every host sees the same shared root

    def begin_join(self, *, gc_grace_s: float | None) -> None:
        """The primary starts taking the epoch (behind a local tier; see ``take_epoch``)."""
        self.start_join(self.collect, gc_grace_s=gc_grace_s)

    def newest(self, agreement: Agreement, *, primary: bool, wait: bool = True) -> int | None:
        """The newest step restorable from this root (the primary's answer; one marker read);
        None unread while it does not answer, unless ``wait``."""
        marker = self.latest() if primary and self._reads(wait) else None
        return None if marker is None else marker.step

    def readable(
        self, agreement: Agreement, listed: Listed, *, primary: bool, wait: bool = True
    ) -> tuple[dict[int, MarkerRef | None], set[int]]:
        """The steps the primary lists here, agreed by every host (with their marker keys
        on the primary only), twice: every host may read every one of them. Nothing while
        this root does not answer, unless ``wait``."""
        reads = primary and self._reads(wait)
        seen: dict[int, MarkerRef | None] = dict(listed(self)) if reads else {}
        shared = agreement.agree(f"restore-{self.name}", sorted(seen))
        return {s: seen.get(s) for s in shared}, set(shared)

    def open_read_only(self, serves: str) -> None:
        """Checks the root record (raises NotACheckpointRootError if it is not there)."""
        self.ensure(create=False)

    def refusal(self, durable: str) -> str | None:
        """None: a shared root serves no other root."""
        return None

    def take_epoch(
        self,
        agreement: Agreement,
        *,
        primary: bool,
        gc_grace_s: float | None,
        serves: str | None = None,
        wait_s: float | None = None,
    ) -> int | None:
        """Becomes this root's writer: the primary takes the epoch (and with ``gc_grace_s``
        collects garbage), which every host then writes in (collective; ``serves`` unused).

        ``wait_s`` (behind a local tier): the primary takes it in the background and the
        open waits at most this long; None returned (on every host) means :attr:`deferred`.
        """
        if wait_s is not None:
            if primary and not self.joining:
                self.begin_join(gc_grace_s=gc_grace_s)
            return self.take_later(agreement, primary=primary, wait_s=wait_s)
        taken = self._take(gc_grace_s, None) if primary else None
        self.protocol.epoch = epoch = agreement.agree(f"{self.name}-epoch", taken)
        return epoch

    def revive(self, serves: str | None) -> bool:
        """False: a shared root wiped under its writer is an error, found by its fence."""
        return False

    def check_served(self, agreement: Agreement, durable: str) -> None:
        """Nothing to check: a shared root serves no other root."""

    def check_alone(self, agreement: Agreement) -> None:
        """Nothing to check: every host shares this root by design."""

    def prunes(self, *, primary: bool) -> bool:
        """Whether this host applies retention here: the primary does, for the job (once
        its epoch is adopted)."""
        return primary and not self.deferred
