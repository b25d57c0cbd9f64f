"""The commit protocol's read model: markers, epochs, hints and a step's records.

Imports no jax, so listing tools start fast. Which markers are visible
follows the epoch rule of :mod:`jaxckpt.commit._fence`; the newest step is found
through the hints of :mod:`jaxckpt.commit._hints`. The write protocol (begin,
records, commit, retract) is :class:`jaxckpt.commit._protocol.CommitProtocol`, which
extends this reader.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from jaxckpt import _pools as pools
from jaxckpt.commit._fence import EpochReader, Epochs, Listing
from jaxckpt.commit._hints import Hints
from jaxckpt.commit._window import windowed_map
from jaxckpt.errors import (
    CorruptCheckpointError,
    NotACheckpointRootError,
    StepNotFoundError,
    UncommittedStepError,
    UnsupportedFormatError,
)
from jaxckpt.records import (
    COMMITS,
    PENDING,
    ROOT_RECORD,
    TREE_FILE,
    CommitMarker,
    FileDigest,
    ManifestPart,
    MarkerRef,
    crc32c,
    dumps,
    load_json_record,
    marker_key,
    marker_refs_of,
    parse_marker_key,
)
from jaxckpt.storage import Storage

log = logging.getLogger("jaxckpt")

_T = TypeVar("_T")
_R = TypeVar("_R")


class CommitReader:
    """Reads the protocol's records on one :class:`Storage` root: which steps are
    committed (markers visible by the epoch rule), the newest one, and a step's records.

    ``epoch`` is None for a reader; a writer (:class:`~jaxckpt.commit._protocol.CommitProtocol`)
    sets it when it takes the root, and its own listings then use it.
    """

    def __init__(self, storage: Storage, *, list_workers: int = 16) -> None:
        self.storage = storage
        self.epochs = EpochReader(storage)
        self.epoch: int | None = None
        self._list_workers = list_workers
        self.hints = Hints(storage, lambda: self.epoch)
        self._once = threading.local()  # latest_once's answer, on its thread only

    def check_root(self) -> None:
        """Checks the root record (a reader's open; a writer's is ``CommitProtocol.ensure_root``).

        Raises:
          NotACheckpointRootError: no root record.
          UnsupportedFormatError: the root was written by a newer format.
        """
        data = self.storage.read(ROOT_RECORD)
        if data is None:
            raise NotACheckpointRootError(
                f"{self.storage.uri} is not a jaxckpt root (no {ROOT_RECORD})"
            )
        load_json_record(data, self.where(ROOT_RECORD))

    def where(self, key: str = "") -> str:
        """The full URI of ``key``, for messages."""
        return f"{self.storage.uri.rstrip('/')}/{key}"

    # -- committed steps ----------------------------------------------------

    def marker_refs(self) -> list[MarkerRef]:
        """Every marker object under ``commits/`` (valid or not, visible or not)."""
        return marker_refs_of(self.storage.list(COMMITS))

    def step_listing(self, step: int) -> Listing:
        """The fence and ``step``'s own markers (for one save's checks), constant in the number
        of steps: an older epoch's marker is visible only if this writer's ``known`` has its
        step, so else only this and newer epochs' keys are read (a known step lists all)."""
        guess: Future[bytes | None] | None = None
        with pools.borrow("listing", 1) as pool:
            if self.epoch is not None:  # usually the only key to read: read it meanwhile
                guess = pool.submit(self.storage.read, marker_key(step, self.epoch))
            epochs = self.epochs.load()
            own = None if self.epoch is None else epochs.records.get(self.epoch)
            if own is None or own.known is None or step in own.known:
                return Listing(epochs, tuple(self.marker_refs()))
            keys = [marker_key(step, e) for e in sorted(epochs.records) if e >= own.epoch]
            found = {marker_key(step, self.epoch): guess.result()} if guess is not None else {}
            rest = [k for k in keys if k not in found]
            found.update(zip(rest, self.map(self.storage.read, rest), strict=True))
        return Listing(epochs, tuple(marker_refs_of(k for k in keys if found[k])))

    def visible_refs(
        self, epochs: Epochs | None = None, refs: Sequence[MarkerRef] | None = None
    ) -> dict[int, MarkerRef]:
        """Steps whose marker is visible by the epoch rule (from keys only, no reads)."""
        epochs = self.epochs.load() if epochs is None else epochs
        result: dict[int, MarkerRef] = {}
        for ref in self.marker_refs() if refs is None else refs:
            if epochs.visible(ref):
                result[ref.step] = max(ref, result.get(ref.step, ref))
        return result

    def read_ref(self, ref: MarkerRef) -> CommitMarker | None:
        """The marker behind ``ref``, or None when absent or invalid (logged).

        Raises:
          UnsupportedFormatError: the marker has a newer format version.
        """
        marker = None
        for _ in range(2):  # a byte flipped in transit fails once, stored damage twice
            data = self.storage.read(ref.key)
            if data is None:
                return None  # never written, or deleted since the listing
            try:
                marker = CommitMarker.from_bytes(data, self.where(ref.key))
                break
            except UnsupportedFormatError:
                raise
            except CorruptCheckpointError as e:
                error = e
        if marker is None:
            log.warning("damaged commit marker (step %d not restorable): %s", ref.step, error)
            return None
        if marker.step != ref.step or marker.epoch != ref.epoch:
            log.warning(
                "damaged commit marker %s: names another step or epoch", self.where(ref.key)
            )
            return None
        return marker

    def read_marker(self, step: int, listing: Listing | None = None) -> CommitMarker | None:
        """The step's visible, valid marker, or None (``listing``: one just taken)."""
        ref = (self.visible_refs() if listing is None else listing.visible()).get(step)
        return None if ref is None else self.read_ref(ref)

    def committed(self) -> dict[int, CommitMarker]:
        """Every visible committed step with its validated marker, ascending."""
        refs = sorted(self.visible_refs().values())
        markers = self.map(self.read_ref, refs)
        return {r.step: m for r, m in zip(refs, markers, strict=True) if m is not None}

    @contextlib.contextmanager
    def latest_once(self) -> Iterator[None]:
        """Inside, :meth:`latest` reads the root once on this thread (a restore asks it as
        healing starts, then for its candidates; nothing it does writes this root)."""
        self._once.on = True
        try:
            yield
        finally:
            self._once.__dict__.clear()

    def latest(self) -> CommitMarker | None:
        """The newest visible valid marker (see :meth:`_latest`; once inside ``latest_once``)."""
        if "marker" in self._once.__dict__:
            marker: CommitMarker | None = self._once.marker
            return marker
        marker = self._latest()
        if getattr(self._once, "on", False):
            self._once.marker = marker
        return marker

    def _latest(self) -> CommitMarker | None:
        """The newest visible valid marker, reading markers newest first until one is valid.

        A constant number of small requests, whatever the number of steps: the
        newest visible step is either the newest step the current epoch
        committed — at most its hint, which its writer raises *before* each
        marker — or the step that epoch resumed from (every older epoch's
        visible step is in its ``known`` set). So one marker is read; only
        when it is missing or damaged (a commit that failed after its hint, a
        deleted step) does this fall back to listing every marker.
        """
        numbers = self.epochs.numbers()
        if numbers:
            newest = self.epochs.record(numbers[-1])
            hint = self.hints.read(newest.epoch)
            resumed = newest.resumed_from
            if hint is not None and (resumed is None or hint >= resumed):
                guess: MarkerRef | None = MarkerRef(
                    step=hint, epoch=newest.epoch, key=marker_key(hint, newest.epoch)
                )
            elif resumed is not None and newest.resumed_key is not None:
                guess = parse_marker_key(newest.resumed_key)
            else:
                guess = None
            marker = self.read_ref(guess) if guess is not None else None
            if marker is not None:
                return marker
        return self._newest_valid(self.visible_refs())

    def _newest_valid(self, visible: dict[int, MarkerRef]) -> CommitMarker | None:
        for ref in sorted(visible.values(), reverse=True):
            marker = self.read_ref(ref)
            if marker is not None:
                return marker
        return None

    def marker_or_latest(self, step: int | None) -> CommitMarker:
        """The marker of ``step``, or of the newest committed step when ``step`` is None.

        Raises:
          NotACheckpointRootError: ``step`` is None and nothing is committed.
          StepNotFoundError / UncommittedStepError: no committed ``step``.
        """
        if step is not None:
            return self.require_marker(step)
        marker = self.latest()
        if marker is None:
            raise NotACheckpointRootError(f"no committed steps under {self.storage.uri}")
        return marker

    def require_marker(self, step: int, ref: MarkerRef | None = None) -> CommitMarker:
        """The marker of a committed step.

        Args:
          ref: the step's marker as a listing just taken found it (None: list now).

        Raises:
          UncommittedStepError: the step has a save under way or a damaged marker.
          StepNotFoundError: no such step, or it was deleted since it was listed.
        """
        ref = self.visible_refs().get(step) if ref is None else ref
        marker = None if ref is None else self.read_ref(ref)
        if marker is not None:
            return marker
        if ref is not None and self.storage.read(ref.key) is None:
            raise StepNotFoundError(  # listed, then gone: a delete (retention) won the race
                f"step {step} under {self.storage.uri} was deleted while it was being read "
                f"(its commit marker {self.where(ref.key)} was removed after the listing)"
            )
        if ref is not None:
            raise CorruptCheckpointError(
                f"step {step} under {self.storage.uri} has a damaged commit marker "
                f"({self.where(ref.key)}); its data is kept: run `jaxckpt verify` / `jaxckpt ls`"
            )
        if self.storage.list(f"{PENDING}{step}/") or self.storage.read(f"{PENDING}{step}.json"):
            raise UncommittedStepError(
                f"step {step} under {self.storage.uri} is partial (no valid commit marker)"
            )
        steps = sorted(self.committed())
        raise StepNotFoundError(
            f"step {step} not found under {self.storage.uri}; committed steps: {brief(steps)}"
        )

    def still_committed(self, marker: CommitMarker) -> bool:
        """Whether ``marker``'s attempt is still the step's visible commit."""
        ref = self.visible_refs().get(marker.step)
        return ref is not None and ref.key == marker.key

    # -- reading a step's records --------------------------------------------

    def read_step_file(self, marker: CommitMarker, name: str) -> bytes:
        """Reads a file the marker covers and checks it: against its size and CRC32C in the
        marker, or (a manifest part of version 4 on, which the marker lists no digest of)
        against its own CRC32C.

        Raises:
          CorruptCheckpointError: missing or altered.
        """
        if name not in marker.files and marker.covers(name):
            return self.read_part(marker, name)[0]
        key = marker.location.key(name)
        expected = marker.files.get(name)
        for attempt in range(2):  # a byte flipped in transit fails once, stored damage twice
            data = self.storage.read(key)
            if data is None or expected is None:
                raise CorruptCheckpointError(f"step {marker.step}: {self.where(key)} is missing")
            if FileDigest.of(data) == expected:
                if attempt:
                    log.warning("%s failed its checksum once, read again intact", self.where(key))
                return data
        raise CorruptCheckpointError(
            f"step {marker.step}: {self.where(key)} does not match its checksum (read twice)"
        )

    def read_part(self, marker: CommitMarker, name: str) -> tuple[bytes, ManifestPart]:
        """Reads and checks one manifest part the marker covers; returns its bytes and it.

        A part whose digest the marker holds (older formats) is checked against it; a
        part of version 4 on checks itself, and must be the step's part of the process
        its name says.

        Raises:
          CorruptCheckpointError: missing, altered, malformed or not the marker's part.
          UnsupportedFormatError: a part of a newer format version.
        """
        key = marker.location.key(name)
        where = self.where(key)
        if name in marker.files:
            data = self.read_step_file(marker, name)
            return data, ManifestPart.from_bytes(data, where)
        if not marker.covers(name):
            raise CorruptCheckpointError(f"step {marker.step}: the marker covers no {where}")
        for attempt in range(2):  # a byte flipped in transit fails once, stored damage twice
            stored = self.storage.read(key)
            if stored is None:
                raise CorruptCheckpointError(f"step {marker.step}: {where} is missing")
            data = stored
            try:
                part = ManifestPart.from_bytes(data, where, self_checked=True)
            except UnsupportedFormatError:
                raise
            except CorruptCheckpointError as e:
                if attempt:
                    raise CorruptCheckpointError(f"step {marker.step}: {e} (read twice)") from e
                continue
            process = name.removeprefix("manifest/").split(".")[0]
            if part.step != marker.step or str(part.process) != process:
                raise CorruptCheckpointError(
                    f"step {marker.step}: {where} is the part of process {part.process} of "
                    f"step {part.step}"
                )
            if attempt:
                log.warning("%s failed its checksum once, read again intact", where)
            return data, part
        raise AssertionError("unreachable")

    def read_manifest(self, marker: CommitMarker) -> list[ManifestPart]:
        return self.read_step(marker, tree=False)[1]

    def read_step(
        self, marker: CommitMarker, *, tree: bool = True, parts: Sequence[str] | None = None
    ) -> tuple[bytes | None, list[ManifestPart]]:
        """The step's tree record (if ``tree``) and manifest parts, read at once and checked.

        Args:
          parts: the names of the parts to read (None: every part the marker covers;
            then, from version 4 on, the set is also checked against the marker's
            ``parts_crc32c``).
        """
        names = marker.manifest_names() if parts is None else list(parts)
        jobs: Iterable[Callable[[], Any]] = itertools.chain(  # made as taken: a stored count
            [lambda: self.read_step_file(marker, TREE_FILE)] * tree,
            (functools.partial(self.read_part, marker, n) for n in names),
        )
        done = self.map(lambda job: job(), jobs, size=tree + len(names))
        tree_data, read = done[: int(tree)], done[int(tree) :]
        if parts is None and marker.parts_crc32c is not None:
            listed = dumps([[n, len(d), crc32c(d)] for n, (d, _) in zip(names, read, strict=True)])
            if crc32c(listed) != marker.parts_crc32c:
                raise CorruptCheckpointError(
                    f"step {marker.step}: the manifest parts under "
                    f"{self.where(marker.location.prefix)} are not the ones its marker covers"
                )
        return (tree_data[0] if tree else None), [part for _, part in read]

    def map(self, fn: Callable[[_T], _R], items: Iterable[_T], size: int | None = None) -> list[_R]:
        """``fn`` over ``items`` on a small thread pool (many small reads), a bounded
        window of them in flight; ``size``: how many ``items`` yields (None: counted)."""
        if size is None:
            items = list(items)
            size = len(items)
        if size <= 1:
            return [fn(i) for i in items]
        workers = min(self._list_workers, size)
        with pools.borrow("map", workers) as pool:  # a count read from storage: never all queued
            return windowed_map(pool, fn, items, window=2 * workers)


def brief(steps: list[int], limit: int = 20) -> str:
    """A short text of a list of steps (first and last few of a long one)."""
    if not steps:
        return "none"
    if len(steps) <= limit:
        return ", ".join(map(str, steps))
    head = ", ".join(map(str, steps[: limit // 2]))
    tail = ", ".join(map(str, steps[-limit // 2 :]))
    return f"{head}, ... {tail} ({len(steps)} steps)"
