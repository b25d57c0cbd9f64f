"""Writer epochs: which writer of a root is current, and which commits are visible.

Opening a writable manager takes a new epoch: a create-only record
``writers/<epoch>.json`` one above the newest, naming the steps that were
visible at that moment (``known``). A writer of an older epoch is *fenced*: it
checks for a newer epoch before it commits and before each deletion and raises
:class:`~jaxckpt.errors.WriterFencedError`.

That check can race with a takeover, so visibility itself is safe: a marker
written by epoch *E* is visible only if its step is in the ``known`` set of
every epoch newer than *E*. A zombie that commits after a newer epoch took
over is therefore never listed, whatever the timing. Imports no jax.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from jaxckpt.errors import CheckpointError, StorageError
from jaxckpt.records import WRITERS, MarkerRef, dumps, epoch_key, load_json_record, parse_epoch_key
from jaxckpt.storage import PreconditionFailed, Storage

log = logging.getLogger("jaxckpt")

_TAKE_ATTEMPTS = 64


@dataclass(frozen=True, kw_only=True)
class EpochRecord:
    """A writer's claim on a root (``writers/<epoch>.json``).

    ``known`` is None when the record cannot be read (it then hides nothing).
    """

    epoch: int
    time: float = 0.0
    owner: str = ""
    known: frozenset[int] | None = None
    resumed_key: str | None = None  # the marker key of ``resumed_from`` at the takeover

    @property
    def resumed_from(self) -> int | None:
        return max(self.known) if self.known else None

    def to_bytes(self) -> bytes:
        from jaxckpt.records import FORMAT, FORMAT_VERSION

        return dumps(
            {
                "format": FORMAT,
                "version": FORMAT_VERSION,
                "epoch": self.epoch,
                "time": self.time,
                "owner": self.owner,
                "known": sorted(self.known or ()),
                "resumed_from": self.resumed_from,
                "resumed_key": self.resumed_key,
            }
        )

    @classmethod
    def from_bytes(cls, epoch: int, data: bytes | None, where: str) -> EpochRecord:
        if data is None:
            return cls(epoch=epoch)
        try:
            obj = load_json_record(data, where)
            return cls(
                epoch=epoch,
                time=float(obj["time"]),
                owner=str(obj.get("owner", "")),
                known=frozenset(int(s) for s in obj["known"]),
                resumed_key=obj.get("resumed_key"),
            )
        except (CheckpointError, KeyError, TypeError, ValueError) as e:
            log.warning("unreadable writer record %s (%s); it hides no steps", where, e)
            return cls(epoch=epoch)


@dataclass(frozen=True)
class Epochs:
    """The epochs of a root at one moment."""

    records: dict[int, EpochRecord]

    @property
    def newest(self) -> int:
        """The current epoch (0: no writer has taken one; format-1 roots)."""
        return max(self.records, default=0)

    def visible(self, ref: MarkerRef) -> bool:
        """Whether a marker of ``ref.epoch`` is visible: every newer epoch knew its step."""
        for epoch, record in self.records.items():
            if epoch > ref.epoch and record.known is not None and ref.step not in record.known:
                return False
        return True

    def hidden_by(self, ref: MarkerRef) -> int | None:
        """The first newer epoch that hides ``ref``, or None when it is visible."""
        for epoch in sorted(self.records):
            record = self.records[epoch]
            if epoch > ref.epoch and record.known is not None and ref.step not in record.known:
                return epoch
        return None


class EpochReader:
    """Reads ``writers/`` with a cache: epoch records are immutable."""

    def __init__(self, storage: Storage) -> None:
        self._storage = storage
        self._cache: dict[int, EpochRecord] = {}

    def numbers(self) -> list[int]:
        """Every epoch under the root, from one listing."""
        keys = self._storage.list(WRITERS)
        return sorted(e for e in map(parse_epoch_key, keys) if e is not None)

    def newest(self) -> int:
        return max(self.numbers(), default=0)

    def record(self, epoch: int) -> EpochRecord:
        if epoch not in self._cache:
            where = f"{self._storage.uri.rstrip('/')}/{epoch_key(epoch)}"
            data = self._storage.read(epoch_key(epoch))
            self._cache[epoch] = EpochRecord.from_bytes(epoch, data, where)
        return self._cache[epoch]

    def load(self) -> Epochs:
        return Epochs({e: self.record(e) for e in self.numbers()})

    def take(self, visible: Callable[[Epochs], Mapping[int, MarkerRef]]) -> EpochRecord:
        """Creates a new epoch one above the newest, recording the visible steps.

        ``visible`` (step -> its marker) is asked again whenever another writer
        took the epoch first, so ``known`` reflects the epochs below the new one.

        Raises:
          StorageError: no epoch could be taken (endless contention).
        """
        owner = f"{socket.gethostname()}:{os.getpid()}"
        for _ in range(_TAKE_ATTEMPTS):
            epochs = self.load()
            refs = visible(epochs)
            record = EpochRecord(
                epoch=epochs.newest + 1,
                time=time.time(),
                owner=owner,
                known=frozenset(refs),
                resumed_key=refs[max(refs)].key if refs else None,
            )
            try:
                self._storage.write(epoch_key(record.epoch), record.to_bytes(), exclusive=True)
            except PreconditionFailed:
                continue
            self._cache[record.epoch] = record
            return record
        raise StorageError(
            f"could not take a writer epoch under {self._storage.uri}: "
            f"{_TAKE_ATTEMPTS} concurrent writers took it first"
        )


@dataclass(frozen=True)
class Listing:
    """One look at ``writers/`` and ``commits/``, shared by the checks of one phase.

    A save's phases each need the fence (the newest epoch) and the visible
    steps; one listing of each prefix, taken concurrently, answers both. A
    listing may be a moment old when it is used: the fence check is advisory,
    the visibility rule (:mod:`jaxckpt.commit._fence`) is what makes a zombie's
    commit invisible whatever the timing.
    """

    epochs: Epochs
    refs: tuple[MarkerRef, ...]  # every marker, or (``step_listing``) those of one step

    def visible(self) -> dict[int, MarkerRef]:
        """Steps whose marker is visible by the epoch rule."""
        result: dict[int, MarkerRef] = {}
        for ref in self.refs:
            if self.epochs.visible(ref):
                result[ref.step] = max(ref, result.get(ref.step, ref))
        return result
