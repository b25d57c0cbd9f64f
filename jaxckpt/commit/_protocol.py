"""The commit-marker protocol. Imports no jax, so listing tools start fast.

Keys come from :mod:`jaxckpt.records._keys`; epochs and visibility from
:mod:`jaxckpt.commit._fence`; the read model (markers, epochs, hints, reading a
step) from :mod:`jaxckpt.commit._readmodel`; garbage collection lives in
:mod:`jaxckpt.commit._gc`. This module is the write protocol.

A save of step *s* is one *attempt* with its own prefix: ``pending`` record,
then data, manifest parts and the tree record (each durable before the next
phase), then the commit marker ``commits/<s>.e<epoch>.json`` with a
create-only write, naming the attempt and its files' checksums; then the
pending record goes. Two writers of one step never share a key, so the data a
marker names is exactly what its writer wrote. A delete writes a pending
record, retracts the marker, then removes the attempt's data. Nothing relies
on rename, nothing overwrites data a valid marker names.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from types import EllipsisType

from jaxckpt import _pools as pools
from jaxckpt.commit._commitcheck import CommitCheck
from jaxckpt.commit._fence import EpochRecord, Epochs, Listing
from jaxckpt.commit._objects import list_attempt, remove_attempt
from jaxckpt.commit._phases import reached
from jaxckpt.commit._readmodel import CommitReader, brief
from jaxckpt.commit._slots import commit_names
from jaxckpt.commit._tidy import Tidying
from jaxckpt.errors import (
    CorruptCheckpointError,
    NotACheckpointRootError,
    StepAlreadyExistsError,
    StorageError,
    WriterFencedError,
)
from jaxckpt.records import (
    FORMAT_VERSION,
    ROOT_RECORD,
    TREE_FILE,
    CommitMarker,
    ManifestPart,
    PartSummary,
    StepLocation,
    json_record,
    load_json_record,
    manifest_name,
    marker_key,
    marker_refs_of,
    parts_crc32c,
)
from jaxckpt.storage import PreconditionFailed, Storage, no_space

log = logging.getLogger("jaxckpt")

__all__ = ["CommitProtocol", "CommitReader", "brief"]


class CommitProtocol(CommitReader):
    """Writes the protocol's records on one :class:`Storage` root (and reads them, as a
    :class:`~jaxckpt.commit._readmodel.CommitReader`): the root record, the writer epoch and
    fence, a save's pending record, records and commit marker, and a delete's retraction.

    A protocol with an ``epoch`` (see :meth:`take_epoch`) is a writer: it
    checks the fence before it begins, commits or deletes. One without an
    epoch (the CLI's ``prune``, ``gc``, ``cp``) writes as an operator in the
    current epoch and never fences anyone.
    """

    def __init__(self, storage: Storage, *, list_workers: int = 16) -> None:
        super().__init__(storage, list_workers=list_workers)
        self.tidying = Tidying(storage)

    # -- root and epochs ----------------------------------------------------

    def ensure_root(self, *, create: bool, found: bytes | EllipsisType | None = ...) -> None:
        """Checks the root record; with ``create``, writes (or upgrades) it.

        A writable open upgrades a format-1 root record to this format, so a
        jaxckpt too old to honour writer epochs refuses to write to it.
        ``found``: the root record the caller has just read (None: there is none), so that
        it is read once; unset, it is read here.

        Raises:
          NotACheckpointRootError: no root record and not ``create``.
          UnsupportedFormatError: the root was written by a newer format.
        """
        data = self.storage.read(ROOT_RECORD) if found is ... else found
        if data is None:
            if not create:
                raise NotACheckpointRootError(
                    f"{self.storage.uri} is not a jaxckpt root (no {ROOT_RECORD})"
                )
            with contextlib.suppress(PreconditionFailed):  # another process created it
                self.storage.write(ROOT_RECORD, json_record(created=time.time()), exclusive=True)
            data = self.storage.read(ROOT_RECORD) or b""
        record = load_json_record(data, self.where(ROOT_RECORD))
        if create and record.get("version", 0) < FORMAT_VERSION:
            upgraded = {k: v for k, v in record.items() if k not in ("format", "version")}
            self.storage.write(ROOT_RECORD, json_record(**upgraded, upgraded=time.time()))

    def take_epoch(self, commit_keys: Sequence[str] | None = None) -> EpochRecord:
        """Makes this protocol the root's writer with a new epoch; fences older writers.
        ``commit_keys``: a listing of ``commits/`` just taken, for the first try only."""
        first = [self.marker_refs() if commit_keys is None else marker_refs_of(commit_keys)]
        for newest in first[0][-1:]:  # a newer format's marker: UnsupportedFormatError, no epoch
            self.read_ref(newest)
        record = self.epochs.take(lambda e: self.visible_refs(e, first.pop() if first else None))
        self.epoch = record.epoch
        self.hints.taken(record.epoch)  # the first commit raises its hint in its batch
        log.info(
            "took writer epoch %d of %s (newest step at takeover: %s)",
            record.epoch,
            self.storage.uri,
            record.resumed_from,
        )
        return record

    def check_fence(self, action: str, epochs: Epochs | None = None) -> None:
        """Raises if a newer writer took over the root (no-op without an epoch).

        Args:
          epochs: a listing of the epochs just taken; None lists them.

        Raises:
          WriterFencedError: a newer epoch exists.
        """
        if self.epoch is None:
            return
        newest = self.epochs.newest() if epochs is None else epochs.newest
        if newest > self.epoch:
            raise WriterFencedError(
                f"cannot {action}: writer epoch {self.epoch} of {self.storage.uri} was fenced "
                f"by epoch {newest} (another process opened the root for writing)"
            )

    def write_epoch(self) -> int:
        """The epoch new attempts are written in: this writer's, else the current one."""
        return self.epoch if self.epoch is not None else self.epochs.newest()

    # -- writing a step -----------------------------------------------------

    def announce(self, loc: StepLocation) -> None:
        """Writes the attempt's pending record (before any of its data)."""
        record = json_record(
            operation="save", started=time.time(), step=loc.step, attempt=loc.attempt
        )
        self.storage.write(loc.pending_key, record)

    def begin_save(
        self, loc: StepLocation, listing: Listing | None = None, *, announced: bool = False
    ) -> None:
        """Announces a save attempt (its pending record). Never deletes anything.

        Args:
          listing: the listing this save's caller just took (None: take one).
          announced: the caller wrote the pending record (:meth:`announce`) while
            it took ``listing``: only the checks are left.

        Raises:
          StepAlreadyExistsError: the step is committed (or has a damaged marker).
          WriterFencedError: a newer writer took over.
        """
        listing = self.step_listing(loc.step) if listing is None else listing
        self.check_absent(loc.step, listing)
        self.check_fence(f"save step {loc.step}", listing.epochs)
        if not announced:
            self.announce(loc)
        reached("pending_written", loc.step)

    def check_absent(self, step: int, listing: Listing) -> None:
        """Raises StepAlreadyExistsError if ``listing`` shows a visible marker of ``step``."""
        ref = listing.visible().get(step)
        if ref is not None:
            damaged = "" if self.read_ref(ref) is not None else " (with a damaged marker)"
            raise StepAlreadyExistsError(
                f"step {step} already exists under {self.storage.uri}{damaged}"
            )

    def write_manifest_part(
        self, loc: StepLocation, part: ManifestPart, *, name: str | None = None
    ) -> bytes:
        """Writes ``part`` as its process's part (or as ``name``, e.g. a held part); returns
        the bytes written (a commit of this process takes its digest from them)."""
        data = part.to_bytes()
        self.storage.write(loc.key(name or manifest_name(part.process)), data)
        return data

    def write_tree(self, loc: StepLocation, tree: bytes) -> None:
        self.storage.write(loc.tree_key, tree)

    def commit(
        self,
        loc: StepLocation,
        *,
        num_processes: int,
        metrics: dict[str, float] | None = None,
        keep: bool = False,
        processes: Sequence[int] | None = None,
        extra: Sequence[str] = (),
        written: Mapping[str, bytes] | None = None,
        summaries: Mapping[str, PartSummary] | None = None,
    ) -> CommitMarker:
        """Writes the commit marker once the attempt's records and chunks are all present.

        ``processes`` names the manifest parts the marker covers (default: all
        ``num_processes``); a host's own local tier holds only its own part,
        and maybe a held part (``extra``). ``written``: the records this process
        wrote for the attempt, by name (its tree record, its manifest part): their
        digests are taken from these bytes and their presence from the attempt's
        listing. ``summaries``: the other processes' parts as they summarised them
        (gathered with the save's agreement), by name: nor are these read back; the
        listing shows them present and holding, in all, the data objects they name.
        Any other part is read and parsed here (``cp``, promotion).

        Raises:
          CheckpointError: a manifest part, the tree record or a listed chunk is missing.
          StepAlreadyExistsError: another writer committed this step first.
          WriterFencedError: a newer writer took over.
        """
        step = loc.step
        covered = range(num_processes) if processes is None else processes
        part_names = [*(manifest_name(p) for p in covered), *extra]
        names = [TREE_FILE, *part_names]
        written, summaries = written or {}, summaries or {}
        unread = [name for name in names if name not in written and name not in summaries]
        # Every request the commit needs before its marker, in flight at once: the records
        # not written here nor summarised, the attempt's listing (every record, chunk and
        # pack), the fence and this step's markers, and the hint (raised now if this writer
        # knows it is lower, else read).
        raise_hint = self.hints.known_lower(loc.epoch, step)
        # the slots the parts can have used (all 32 when a part is read here)
        listed = commit_names(part_names, written, summaries, lambda n: self.where(loc.key(n)))
        with pools.borrow("commit", self._list_workers) as pool:
            reads = [pool.submit(self.storage.read, loc.key(name)) for name in unread]
            attempt_keys = pool.submit(list_attempt, self.storage, loc, listed)
            step_listing = pool.submit(self.step_listing, step)
            hint = (
                pool.submit(self.hints.raise_to, loc.epoch, step)
                if raise_hint
                else pool.submit(self.hints.read, loc.epoch)
            )
            read = dict(zip(unread, [future.result() for future in reads], strict=True))
            listing = step_listing.result()
            present = set(attempt_keys.result())
            hinted = hint.result()
        check = CommitCheck(self.storage, loc, self.where)
        files, parsed, summary = check.records(names, read, written, present)
        summary.update({n: s for n, s in summaries.items() if n in part_names})
        others = [summary[n] for n in part_names if n not in parsed]
        check.objects(present, part_names, parsed, others)
        in_order = [summary[n] for n in part_names]
        marker = CommitMarker(
            step=step,
            time=time.time(),
            num_processes=num_processes,
            files=files,
            nbytes=sum(s.nbytes for s in in_order),
            metrics=dict(metrics or {}),
            keep=keep,
            attempt=loc.attempt,
            epoch=loc.epoch,
            parts=None if processes is None and not extra else tuple(part_names),
            parts_crc32c=parts_crc32c(part_names, in_order),
        )
        self.check_fence(f"commit step {step}", listing.epochs)
        if step in listing.visible():
            raise StepAlreadyExistsError(
                f"step {step} was committed by another writer under {self.storage.uri}"
            )
        if hinted is None or hinted < step:  # raised before the marker, never lowered
            self.hints.raise_to(loc.epoch, step)
        reached("before_marker", step)
        try:
            self.storage.write(marker_key(step, loc.epoch), marker.to_bytes(), exclusive=True)
        except PreconditionFailed as e:
            raise StepAlreadyExistsError(
                f"step {step} was committed by another writer under {self.storage.uri}"
            ) from e
        reached("marker_written", step)
        self.tidying.drop(loc)  # committed: the pending record goes in the background
        return marker

    def abandon(self, loc: StepLocation) -> bool:
        """Removes an uncommitted attempt; returns False (and keeps it) if a marker names it.

        Also False if data reappeared under it while it was removed (a fenced
        writer still writing): its pending record is then kept for the next collection.

        The check covers a marker whose write reported a failure but landed (a
        lost response after the last retry) and a commit racing a collection.
        """
        key = marker_key(loc.step, None if loc.attempt is None else loc.epoch)
        data = self.storage.read(key)
        if data is not None:
            try:
                named = CommitMarker.from_bytes(data, self.where(key)).location == loc
            except CorruptCheckpointError:
                named = True  # a damaged marker of this step: its data is kept
            if named:
                log.warning("kept %s: %s names it", loc, self.where(key))
                return False
        return self._remove(loc)

    def _remove(self, loc: StepLocation) -> bool:
        """Deletes an attempt's data, then its pending record once a listing shows it gone.

        A fenced writer still writing into the attempt can refill it: keeping
        the pending record keeps the attempt in every scan, so the next
        collection finishes it (without the record its data would be an
        orphan that only a full scan finds). False if data is left.
        """
        if not remove_attempt(self.storage, loc):
            log.warning("%s refilled while it was removed; collecting the rest later", loc)
            return False
        self.storage.delete(loc.pending_key)
        return True

    # -- deleting -----------------------------------------------------------

    def delete(self, step: int, *, marker: CommitMarker | None = None) -> None:
        """Deletes a committed step: retract the marker first, then the attempt's data.

        Raises:
          StepNotFoundError: no such committed step.
          WriterFencedError: a newer writer took over, or the step is a newer writer's.
        """
        marker = marker or self.require_marker(step)
        self.check_fence(f"delete step {step}")
        if self.epoch is not None and marker.epoch > self.epoch:
            raise WriterFencedError(
                f"cannot delete step {step} under {self.storage.uri}: it was committed by "
                f"writer epoch {marker.epoch}, newer than this writer's {self.epoch}"
            )
        self.retract(marker.location, marker.key)

    def retract(self, loc: StepLocation, key: str) -> None:
        """Deletes a marker and then the data it names, announced by a pending record."""
        self.tidying.before_delete(loc)  # the save's record goes first (the same key)
        record = json_record(operation="delete", started=time.time(), step=loc.step)
        try:
            self.storage.write(loc.pending_key, record)
        except StorageError as e:
            if not no_space(e):
                raise
            log.warning(
                "step %d: %s is full: deleted without its record", loc.step, self.storage.uri
            )
        self.storage.delete(key)  # (cut short then: its data is found by `jaxckpt gc --full`)
        reached("delete_retracted", loc.step)
        self._remove(loc)  # what is left is an interrupted delete: every collection finishes it
