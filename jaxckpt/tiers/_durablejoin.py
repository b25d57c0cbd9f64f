"""Joining the durable root in the background, so that an outage of the durable root does
not stop a job whose local tier holds what it needs.

Opening a tiered manager takes a new writer epoch of the durable root (the primary
does, then every host writes in it). In a storm of ``503 SlowDown`` every request is
retried, so the open waited for the storm's end (and failed after ``save_timeout_s``
of an outage) although the local tiers held the step to resume from. Instead the
primary takes the epoch on a thread of its own (:class:`DurableJoin`) and the open
waits for nothing: what a job does next (building and compiling its step) overlaps
the join. The first use of the durable root (``latest_step``, ``restore``, a save)
catches up (:meth:`JoinedLater.catch_up`): the primary waits for the join until
``CheckpointOptions.durable_wait_s`` after it began, and every host adopts its epoch.
When it has not answered by then, the job trains from its local tier meanwhile:

* a restore takes the newest step every host holds locally (the durable root is
  read only when no local step is complete everywhere, and then waited for);
* promotion requests are written unstamped (epoch ``records.UNSTAMPED``, which no
  promoter copies) and stamped with the epoch once every host has learned it at a
  save (:meth:`~jaxckpt.lifecycle.Promotion.request`; a lone process also while
  ``wait_durable`` waits);
* what a save can do without (health records, the run ledger, durable retention)
  waits for the epoch or is skipped, said once in the log.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

from jaxckpt.commit import Agreement, CommitProtocol
from jaxckpt.errors import CheckpointError, StorageError
from jaxckpt.records import COMMITS, ROOT_RECORD
from jaxckpt.storage import Storage

__all__ = ["DurableJoin", "JoinedLater"]

log = logging.getLogger("jaxckpt")

SETTLE_S = 10.0
"""How long closing waits for the garbage collection that followed the epoch."""
RETRY_S = (1.0, 30.0)
"""The first and the longest wait between two tries of a join."""


class DurableJoin:
    """The primary's background take of the durable root's epoch (and garbage collection).

    Args:
      storage: the durable root.
      gc_grace_s: with it, garbage is collected after the epoch is taken.
      collect: ``collect(grace_s, commit_keys)``, the tier's collection.
    """

    def __init__(
        self,
        storage: Storage,
        gc_grace_s: float | None,
        collect: Callable[[float, list[str]], None],
    ) -> None:
        self._storage = storage
        self.began = time.monotonic()
        self._grace = gc_grace_s
        self._collect = collect
        self._answered = threading.Event()  # a request of the join succeeded
        self._taken = threading.Event()
        self._done = threading.Event()
        self._stop = threading.Event()
        self.epoch: int | None = None
        self.new_root = False
        """The join's first answer: no root record (a new root, which holds no step)."""
        self.error: CheckpointError | None = None
        """A failure that ends the join (not a storage error: those are retried)."""
        self._thread = threading.Thread(target=self._run, name="jaxckpt-durable-join", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        delay, tries = RETRY_S[0], 0
        while not self._stop.is_set():
            tries += 1
            try:
                self._take()
                return
            except StorageError as e:  # an outage: tried again until it ends
                if tries == 1 or tries % 10 == 0:
                    log.warning(
                        "durable root %s: no writer epoch yet (try %d; again in %.0fs): %s",
                        self._storage.uri,
                        tries,
                        delay,
                        e,
                    )
            except Exception as e:  # not an outage (a newer format, a bug): said, for good
                self.error = e if isinstance(e, CheckpointError) else CheckpointError(str(e))
                log.error("durable root %s cannot be joined: %s", self._storage.uri, e)
                break
            self._stop.wait(delay)
            delay = min(2 * delay, RETRY_S[1])
        self._answered.set()  # the join ended (its error, or stopped): no more waiting
        self._taken.set()
        self._done.set()

    def _take(self) -> None:
        began = time.monotonic()
        protocol = CommitProtocol(self._storage)
        found = self._storage.read(ROOT_RECORD)  # the root answers
        self.new_root = found is None
        self._answered.set()
        protocol.ensure_root(create=True, found=found)
        keys = self._storage.list(COMMITS)
        self.epoch = protocol.take_epoch(keys).epoch
        self._taken.set()
        log.info("durable root %s joined in %.2fs", self._storage.uri, time.monotonic() - began)
        try:
            if self._grace is not None:
                self._collect(self._grace, keys)
        finally:
            self._done.set()

    def taken(self, timeout_s: float | None = 0.0) -> int | None:
        """The epoch once taken, waiting at most ``timeout_s`` (None: until the join ends).

        Raises:
          CheckpointError: the join ended without an epoch (its error).
        """
        self._taken.wait(timeout_s)
        if self.epoch is None and self._taken.is_set():
            raise self.error or CheckpointError(f"durable root {self._storage.uri}: join stopped")
        return self.epoch

    def answered(self, timeout_s: float) -> bool:
        """Whether the root has answered a request (it can be read, with or without an
        epoch), waiting at most ``timeout_s``.

        Raises:
          CheckpointError: the join ended for good before (its error).
        """
        answered = self._answered.wait(timeout_s)
        if self.error is not None:
            raise self.error
        return answered

    def settled(self, timeout_s: float) -> None:
        """Waits at most ``timeout_s`` for garbage collection after the epoch."""
        self._done.wait(max(0.0, timeout_s))

    def stop(self) -> None:
        """Ends the tries (the manager closes); a take under way finishes on its own."""
        self._stop.set()


class JoinedLater:
    """The part of a shared tier (``SharedTier``) that may be joined in the background:
    until every host has :meth:`adopt`-ed the epoch, :attr:`deferred` is true and the
    primary reads the root only once it :meth:`answers` (or when nothing else holds a
    step: ``wait``)."""

    storage: Storage
    protocol: CommitProtocol

    def join_later(self, wait_s: float) -> None:
        """Nothing deferred yet; a restore with nothing local waits at most ``wait_s``."""
        self.deferred = False
        """The open went on without this root's epoch; every host learns it later."""
        self._join: DurableJoin | None = None  # the primary's, while deferred
        self._wait_s = wait_s
        self._deadline = 0.0  # the primary's: until then a first use waits for the join
        self._adopted: list[Callable[[int], None]] = []
        self._said = self._late = False

    def take_later(self, agreement: Agreement, *, primary: bool, wait_s: float) -> int | None:
        """The open waits for nothing: the epoch is agreed if the primary's join (begun by
        :meth:`start_join`) has taken it already, else :attr:`deferred` on every host and
        the primary's first use waits for it until ``wait_s`` after the join began
        (collective; None on every host: deferred)."""
        taken = None
        if primary:
            assert self._join is not None, "start_join first"
            self._deadline = self._join.began + wait_s
            taken = self._join.taken(0.0)  # its garbage collection goes on meanwhile
        epoch = agreement.agree("durable-epoch", taken)
        self.protocol.epoch = epoch
        self.deferred = epoch is None
        return epoch

    def catch_up(self, agreement: Agreement, *, closing: bool = False) -> None:
        """While :attr:`deferred`, every host adopts the epoch the primary's join has
        taken, the primary waiting for it until the open's deadline (collective: a
        restore's first step; nothing once adopted). ``closing``: the manager closes, and
        the primary waits up to :data:`SETTLE_S` for a join the root has answered (a
        restore read it before its epoch), so that the run's events are written."""
        if self.deferred:
            epoch = agreement.agree("durable-epoch", self._joined(closing=closing))
            if epoch is not None:
                self.adopt(epoch)

    def _joined(self, *, closing: bool = False) -> int | None:
        """The primary's join's epoch, waited for until the open's deadline (None: not
        taken by then, said once; or no join here); ``closing``: see :meth:`catch_up`."""
        join = self._join
        if join is None:
            return None
        epoch = None
        with contextlib.suppress(CheckpointError):  # a join that failed for good said why
            wait_s = self._deadline - time.monotonic()
            if closing and join.answered(0.0):  # the root answers: its epoch comes soon
                wait_s = max(wait_s, SETTLE_S)
            epoch = join.taken(max(0.0, wait_s))
        if epoch is None and not self._late:
            self._late = True
            log.warning(
                "durable root %s did not answer within %gs: training goes on from the local "
                "tier; its writer epoch is taken in the background and promotion resumes then",
                self.storage.uri,
                self._deadline - join.began,
            )
        return epoch

    def start_join(
        self, collect: Callable[[float, list[str]], None], *, gc_grace_s: float | None
    ) -> None:
        """The primary starts taking the epoch now (:meth:`take_later` waits for it)."""
        self._join = DurableJoin(self.storage, gc_grace_s, collect)

    @property
    def joining(self) -> bool:
        """Whether this process has begun a join (the primary, behind a local tier)."""
        return self._join is not None

    def answers(self) -> bool:
        """Whether this root has answered: always, unless the open went on without it;
        then on the primary once its epoch is taken (waited for until the open's
        deadline), elsewhere once it is adopted."""
        return not self.deferred if self._join is None else self._joined() is not None

    def _reads(self, wait: bool) -> bool:
        """Whether the primary reads this root now: it answers, or ``wait`` (then the join
        is waited for, at most ``wait_s``; a root that never answers raises)."""
        if self.answers():
            return True
        uri = self.storage.uri
        if not wait:
            if not self._said:
                self._said = True
                log.warning("durable root %s does not answer yet: reading the local tier", uri)
            return False
        assert self._join is not None
        log.warning("durable root %s: no local step to restore; waiting for it", uri)
        # Reading needs no epoch: the root's first answer will do (a new root's takes a
        # create-only write more, S3's after a probe of three requests), and a new root
        # holds nothing to read.
        if not self._join.answered(self._wait_s):
            raise StorageError(
                f"durable root {uri} did not answer within {self._wait_s:g}s "
                "and no local tier holds a step to restore"
            )
        return not self._join.new_root

    def learned(self) -> int | None:
        """The epoch for every host to adopt (the primary's answer, at a save or a restore):
        the join's, once taken (waited for until the open's deadline); None while not, or
        not deferred."""
        return self._joined() if self.deferred else None

    def adopt(self, epoch: int) -> None:
        """Every host writes in ``epoch`` from now on (learned at a save or a restore)."""
        self.protocol.epoch = epoch
        self.deferred = False
        log.info("joined durable root %s: writer epoch %d", self.storage.uri, epoch)
        for told in self._adopted:
            told(epoch)

    def on_adopt(self, told: Callable[[int], None]) -> None:
        """``told(epoch)`` once the epoch is adopted (at once if it is)."""
        if self.deferred:
            self._adopted.append(told)
        elif self.protocol.epoch is not None:
            told(self.protocol.epoch)

    def stop_joining(self) -> None:
        """Ends the background tries (the manager closes), after the garbage collection
        of a join that took the epoch (at most :data:`SETTLE_S`)."""
        if self._join is not None:
            self._join.stop()
            if self._join.epoch is not None:  # else it never answered: nothing to wait for
                self._join.settled(SETTLE_S)
