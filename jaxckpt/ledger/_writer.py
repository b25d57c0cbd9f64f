"""Writes one process's ledger: batched, bounded objects, off every save's critical path.

:meth:`LedgerWriter.append` only takes a lock and appends to a bounded buffer. A daemon
thread flushes the buffer every ``interval_s``, plus the newest *reached* step when it
changed; :meth:`close` flushes what is left. The first flush runs in the thread that
starts the writer (the manager's open), so a run that dies early is still seen and a
process's first requests (its store's one-off credential lookup among them) belong to its
open, whatever the scheduling: the requests of the saves after it are the same every run.
When the run learns its epoch after the open (the durable root joined in the background,
:meth:`adopt`) the thread flushes at once, so that a run that dies within its first
interval is on the store too, as one whose open wrote. A flush writes one
object per :data:`~jaxckpt.ledger._events.MAX_OBJECT_BYTES` of events
(one, in practice), so the requests per process are one per flush, whatever the number of
saves in it. A write that fails is logged, counted (:attr:`failures`) and retried at the
next flush with the same sequence number; when the store stays down the buffer keeps its
newest :data:`MAX_BUFFERED` events and counts the ones it dropped.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from jaxckpt.ledger._events import MAX_EVENT_BYTES, MAX_OBJECT_BYTES, LedgerObject, ledger_key
from jaxckpt.storage import STUCK_WRITE_S, Storage

log = logging.getLogger("jaxckpt")

MAX_BUFFERED = 10_000
"""Events kept in memory while the store cannot be written (the oldest are dropped)."""
STUCK_S = 5.0
"""A ledger write under way this long is being retried: its store does not answer."""


def _encoded(event: dict[str, Any]) -> dict[str, Any]:
    """``event`` as it is stored: an over-long text field is cut to fit an event's cap."""
    if len(json.dumps(event, allow_nan=False)) <= MAX_EVENT_BYTES:
        return event
    cut = dict(event)
    for name, value in event.items():
        if isinstance(value, str) and len(value) > 256:
            cut[name] = value[:256] + "..."
    return cut


class LedgerWriter:
    """The ledger objects of one process of one run (epoch).

    Args:
      storage: the durable root's storage.
      epoch: the run's writer epoch (every process of the run has the same); None:
        not known yet (the durable root joins in the background): events are kept
        until :meth:`adopt`.
      process, processes: this process's index and the job's process count.
      interval_s: the longest a flushed event waits (and the shortest time between
        two flushes of the background thread).
      before_flush: called before each flush (to append what has happened since).
    """

    def __init__(
        self,
        storage: Storage,
        *,
        epoch: int | None,
        process: int,
        processes: int,
        interval_s: float,
        before_flush: Callable[[], None] | None = None,
    ) -> None:
        self._storage = storage
        self._epoch, self._process, self._processes = epoch, process, processes
        self._interval_s = interval_s
        self._before_flush = before_flush
        self._lock = threading.Lock()
        self._flushing = threading.Lock()
        self._events: deque[dict[str, Any]] = deque()
        self._reached: tuple[int, float] | None = None
        self._reached_written: int | None = None
        self._seq = 0
        self._stop = threading.Event()
        self._soon = threading.Event()  # the flusher's next flush is now
        self._thread: threading.Thread | None = None
        self.failures = 0
        """Ledger writes that failed (each logged; none fails a save)."""
        self.dropped = 0
        """Events dropped because the buffer was full while the store failed."""
        self.objects = 0
        """Ledger objects written."""
        self._writing_since: float | None = None  # the write under way began (monotonic)
        self._last_failed = False

    @property
    def answering(self) -> bool:
        """Whether its store answers, as far as the ledger knows: its last write did not
        fail and none has been under way for :data:`STUCK_S` (retried in an outage)."""
        since = self._writing_since
        return not self._last_failed and (since is None or time.monotonic() - since < STUCK_S)

    @property
    def epoch(self) -> int | None:
        return self._epoch

    def adopt(self, epoch: int) -> None:
        """The run's epoch, learned after the open: what was kept is written at once (by
        the background flusher, not at its next interval; no I/O here)."""
        self._epoch = epoch
        self._soon.set()

    @property
    def process(self) -> int:
        return self._process

    @property
    def where(self) -> str:
        if self._epoch is None:
            return f"{self._storage.uri}/ledger/ (no epoch yet)"
        return f"{self._storage.uri}/{ledger_key(self._epoch, self._process, self._seq)}"

    def start(self) -> None:
        """Flushes what is buffered (never raises), then starts the background flusher."""
        self.flush()
        self._thread = threading.Thread(target=self._run, name="jaxckpt-ledger", daemon=True)
        self._thread.start()

    def append(self, kind: str, t: float | None = None, **fields: Any) -> None:
        """Buffers one event (no I/O)."""
        event = {"kind": kind, "t": time.time() if t is None else t, **fields}
        with self._lock:
            if len(self._events) >= MAX_BUFFERED:
                self._events.popleft()
                self.dropped += 1
            self._events.append(event)

    def reached(self, step: int, t: float) -> None:
        """Notes the newest step the loop reached; written with the next flush."""
        reached = self._reached
        if reached is None or step != reached[0]:
            self._reached = (step, t)  # one assignment (atomic): no lock on the loop's path

    def flush(self, timeout_s: float = -1) -> None:
        """Writes the buffered events (and a changed reached step); never raises.

        Args:
          timeout_s: how long to wait for a flush under way (-1: as long as it takes).
        """
        if self._before_flush is not None:
            try:
                self._before_flush()
            except Exception:  # pragma: no cover - a bug, said; the flush goes on
                log.exception("ledger: collecting events failed")
        if self._epoch is None:  # no epoch to write under yet: kept (bounded) until then
            return
        if not self._flushing.acquire(timeout=timeout_s):
            log.warning("ledger %s: a flush is still under way; not flushed", self.where)
            return
        try:
            with self._lock:
                reached = self._reached
                if reached is not None and reached[0] != self._reached_written:
                    at = len(self._events)  # in time order among the buffered events
                    while at > 0 and self._events[at - 1]["t"] > reached[1]:
                        at -= 1
                    self._events.insert(
                        at, {"kind": "reached", "t": reached[1], "step": reached[0]}
                    )
                    self._reached_written = reached[0]
                pending = list(self._events)
            while pending:
                batch: list[dict[str, Any]] = []
                size = 200
                for event in pending:
                    encoded = _encoded(event)
                    n = len(json.dumps(encoded, separators=(",", ":"))) + 1
                    if batch and size + n > MAX_OBJECT_BYTES:
                        break
                    batch.append(encoded)
                    size += n
                if not self._write(batch):
                    return
                with self._lock:
                    for _ in batch:
                        if self._events:
                            self._events.popleft()
                pending = pending[len(batch) :]
        finally:
            self._flushing.release()

    def _write(self, batch: list[dict[str, Any]]) -> bool:
        epoch = self._epoch
        assert epoch is not None  # flush() writes nothing before
        obj = LedgerObject(
            epoch=epoch,
            process=self._process,
            seq=self._seq,
            processes=self._processes,
            events=tuple(batch),
        )
        key = ledger_key(epoch, self._process, self._seq)
        self._writing_since = time.monotonic()
        try:
            self._storage.write(key, obj.to_bytes())
        except Exception as e:  # the ledger never fails the training job
            self.failures += 1
            self._last_failed = True
            log.warning("ledger write %s failed (%d so far): %s", self.where, self.failures, e)
            return False
        finally:
            self._writing_since = None
        self._last_failed = False
        self._seq += 1
        self.objects += 1
        return True

    def _run(self) -> None:
        while True:
            self._soon.wait(self._interval_s)
            self._soon.clear()
            if self._stop.is_set():
                return
            self.flush()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stops the flusher and writes what is left, waiting at most ``timeout_s`` in all
        (a store that does not answer keeps retrying in a daemon thread, never the caller:
        at interpreter exit the object-store servers may be gone)."""
        deadline = time.monotonic() + timeout_s
        self._stop.set()
        self._soon.set()
        if self._epoch is None:  # the durable root never answered in this run: said, counted
            with self._lock:
                lost, self.dropped = len(self._events), self.dropped + len(self._events)
            log.warning(
                "ledger under %s: %d events not written (the run never learned its durable "
                "epoch: the durable root did not answer)",
                self._storage.uri,
                lost,
            )
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout_s)
        last = threading.Thread(
            target=self.flush,
            args=(max(0.0, deadline - time.monotonic()),),
            name="jaxckpt-ledger-close",
            daemon=True,
        )
        last.start()
        while last.is_alive() and (left := deadline - time.monotonic()) > 0:
            last.join(min(left, 0.05))
            since = self._writing_since
            if since is not None and time.monotonic() - since > STUCK_WRITE_S:
                log.warning(
                    "ledger %s: the last write has been retried for %.0fs (the durable root "
                    "does not answer); not waited for",
                    self.where,
                    STUCK_WRITE_S,
                )
                return
        if last.is_alive():
            log.warning("ledger %s: the last flush did not finish in %.0fs", self.where, timeout_s)
