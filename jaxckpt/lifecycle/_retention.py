"""Retention: one background deleter for every tier of a manager.

After each commit (and each promotion) the deleter applies each tier's rule
(``local_retention`` on a local tier, ``retention`` on the durable one) on one daemon
thread; passes asked for while one runs make one more pass. A step is never deleted
while it is *protected*: being restored, being saved, or waiting for promotion (the
newest ``promote_backlog`` of those, see ``lifecycle._waiting``). An own tier is pruned
by every host, a shared tier by the primary only. Deletions are fence-checked by the
tier's protocol; a fenced deleter reports the fence and stops.

A save that found this process's own tier full asks for room (:meth:`Retention.make_room`):
from then on the passes keep only the newest step there, until its file system has the
room of three more steps (:data:`ROOM_STEPS` times the most a deleted step freed there; a
disk filled by something else often stays full: keeping two again failed every other save).

A pass waits for the health marks (which steps are bad) at most
:attr:`Retention.marks_wait_s`; while the durable root does not answer, the last ones
read apply, so a local tier is pruned through an outage. ``close()`` waits a bounded
time for the pass under way: a deletion cut short at exit is finished by the garbage
collector (the marker goes first).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

from jaxckpt import _pools, policy
from jaxckpt.errors import StorageError, WriterFencedError
from jaxckpt.lifecycle._keep import retention_decision
from jaxckpt.records import CommitMarker
from jaxckpt.tiers import Tier

if TYPE_CHECKING:
    from jaxckpt.lifecycle._nopromotion import NoPromotion
    from jaxckpt.lifecycle._promotion import Promotion

log = logging.getLogger("jaxckpt")

ROOM_STEPS = 3
"""A tier made room on keeps its rule again once it has the room of this many steps more
(the one its rule keeps again, the next save's, and a margin: with two, 4 processes on a
full tmpfs went back to their rule at 2.04 steps free and failed every other save)."""


class Retention:
    """Applies every tier's retention rule in the background.

    Args:
      tiers: the manager's tiers, nearest first.
      primary: this process prunes the shared tiers.
      protected: callables naming steps to keep whatever the rule says (the
        step in flight); restoring steps are added by :meth:`restoring`.
      on_fenced: told when a deletion finds that a newer writer took over.
      bad: the steps marked bad; the newest step of a tier not among them is kept.
      deleted: told of each step deleted from the last (durable) tier (its marks go).
      waiting: the promotion, whose waiting steps are kept (``promote_backlog``; on a
        full own tier none older than its newest step): see ``_waiting.within_backlog``.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        primary: bool,
        protected: Sequence[Callable[[], set[int]]],
        on_fenced: Callable[[WriterFencedError], None],
        bad: Callable[[], set[int]] = set,
        deleted: Callable[[int], None] = lambda step: None,
        waiting: Promotion | NoPromotion | None = None,
    ) -> None:
        self._tiers = tuple(tiers)
        self._waiting = waiting
        self._bad = bad
        self._last_bad: set[int] = set()  # the marks last read (kept through an outage)
        self._reading: Future[set[int]] | None = None  # the marks' read under way
        self._said = False
        self._deleted = deleted
        self._primary = primary
        self._protected = tuple(protected)
        self._on_fenced = on_fenced
        self._lock = threading.Lock()
        self._restoring: set[int] = set()
        self._passes = threading.Condition(threading.Lock())
        self._asked = self._done = 0  # passes asked for; of those, passes finished
        self._tight = False  # passes keep only the newest step of an own tier (it was full)
        self._step_room = 0  # the most a deletion freed on an own tier (a step, its replicas)
        self._thread: threading.Thread | None = None
        self._closed = False
        self.marks_wait_s = 2.0
        """How long a pass waits for the health marks before it uses those last read (the
        read goes on, and a later pass takes its answer)."""
        self.on_deleted: Callable[[str, int, int], None] | None = None
        """Told ``(tier name, step, bytes)`` after each deletion by the rule (the ledger)."""

    @contextlib.contextmanager
    def restoring(self, step: int) -> Iterator[None]:
        """Protects ``step`` from deletion while it is read."""
        with self._lock:
            self._restoring.add(step)
        try:
            yield
        finally:
            with self._lock:
                self._restoring.discard(step)

    def protected(self, full: int | None = None) -> set[int]:
        """Steps no rule may delete now: restoring ∪ in flight ∪ awaiting promotion (but
        those older than ``full``, the newest step of an own tier that is full)."""
        with self._lock:
            steps = set(self._restoring)
        for source in self._protected:
            steps |= source()
        return steps | (set() if self._waiting is None else self._waiting.kept_waiting(full))

    def decision(self, tier: Tier) -> policy.RetentionDecision:
        """What ``tier``'s rule keeps (and why) and deletes now."""
        protected, bad = self.protected(), self._bad()
        return retention_decision(tier.committed(), tier.retention, protected=protected, bad=bad)

    def explain(self, tier: Tier) -> dict[int, tuple[str, ...]]:
        """For every step committed on ``tier``, the rules that keep it (empty: deleted)."""
        committed = tier.committed()
        protected, bad = self.protected(), self._bad()
        decision = retention_decision(committed, tier.retention, protected=protected, bad=bad)
        return {s: decision.keep.get(s, ()) for s in sorted(committed)}

    def delete(self, step: int) -> None:
        """Deletes ``step`` from every tier holding it: the nearest (the one saves go to)
        on this process, the others on the primary.

        Raises:
          StepNotFoundError: no tier holds it (the steps are listed).
        """
        holders = [t for t in self._tiers if t.holds(step)] or [self._tiers[0]]
        for tier in holders:
            if tier is self._tiers[0] or self._primary:
                tier.delete(step)
                if tier is self._tiers[-1]:
                    self._deleted(step)

    # -- the deleter -----------------------------------------------------------

    def committed(self, marker: CommitMarker | None = None) -> None:
        """A step committed (or was promoted): schedule a pass of the deleter."""
        if not any(t.retention is not None for t in self._tiers):
            return
        with self._passes:
            if self._closed:  # a promotion finishing after close() is pruned next time
                return
            self._asked += 1
            if self._thread is None:  # a daemon: exit does not wait for a store's retries
                self._thread = threading.Thread(
                    target=self._run, name="jaxckpt-retention", daemon=True
                )
                self._thread.start()
            self._passes.notify_all()

    def make_room(self, timeout_s: float = 30.0) -> None:
        """A save found this process's own tier full: passes keep there only the newest
        step (and the protected ones) until it has room again (:data:`ROOM_STEPS`); the
        first is waited for at most ``timeout_s``, so that the next save has the room of
        the steps it deletes."""
        own = [t for t in self._tiers if t.own and t.retention is not None]
        if not own:
            return
        log.warning("%s is full: keeping only its newest step there", own[0].uri)
        for tier in own:
            tier.peers.short_of_room(f"{tier.uri} is full")
        with self._passes:
            self._tight = True
        self.committed()
        try:
            self.wait(timeout_s)
        except TimeoutError as e:
            log.warning("%s", e)

    def _roomy(self, tier: Tier) -> bool:
        """Whether an own tier that was full has room again: :data:`ROOM_STEPS` times what
        a deleted step freed there (the most seen) is free (an object store: always; no
        deletion measured yet: not yet)."""
        free = _free(tier)
        if free is not None and (not self._step_room or free < ROOM_STEPS * self._step_room):
            return False
        log.info("%s has room again (%s bytes free): its retention rule applies", tier.uri, free)
        return True

    def _run(self) -> None:
        while True:
            with self._passes:
                self._passes.wait_for(lambda: self._asked > self._done or self._closed)
                if self._asked == self._done:  # closed, nothing asked
                    return
                covered = self._asked  # every pass asked for so far: one pass does
            self.apply()
            with self._passes:
                self._done = covered
                self._passes.notify_all()

    def apply(self) -> None:
        """Deletes, in every tier this process prunes, what its rule does not keep."""
        bad: set[int] | None = None  # read once a pass
        with self._passes:
            tight = self._tight
        try:
            for tier in self._tiers:
                if tier.retention is None or not tier.prunes(primary=self._primary):
                    continue
                committed = tier.committed()
                bad = self._bad_now() if bad is None else bad
                full = tight and tier.own  # its newest step alone (the newest is promoted)
                protected = self.protected(max(committed, default=None) if full else None)
                keep = policy.KeepLast(1) if full else tier.retention
                rule = retention_decision(committed, keep, protected=protected, bad=bad)
                for step in rule.delete:
                    log.info("retention: deleting step %d under %s", step, tier.uri)
                    before = _free(tier)
                    tier.delete(step)
                    if tier.own and before is not None:  # what a step takes here, its replicas
                        self._step_room = max(self._step_room, (_free(tier) or 0) - before)
                    if tier is self._tiers[-1]:
                        self._deleted(step)
                    if self.on_deleted is not None:
                        self.on_deleted(tier.name, step, committed[step].nbytes)
                if tight and tier.own and self._roomy(tier):
                    tier.peers.short_of_room(None)
                    with self._passes:
                        self._tight = False
        except WriterFencedError as e:
            self._on_fenced(e)
            log.error("retention stopped: %s", e)
        except Exception:
            log.exception("retention failed; it will be retried after the next save")

    def _bad_now(self) -> set[int]:
        """The bad steps; while the durable root (where marks live) does not answer within
        ``marks_wait_s`` (once an outage), those last read: local retention goes on in an
        outage (it stopped, and a 503 storm filled a node's disk with every step saved)."""
        reading = self._reading
        if reading is None or reading.done():
            reading = self._reading = _pools.detached("health-marks", self._bad)
        try:
            wait_s = 0.0 if self._said else self.marks_wait_s  # an outage's passes do not wait
            self._last_bad, self._said = reading.result(timeout=wait_s), False
        except (StorageError, TimeoutError) as e:
            if not self._said:  # once an outage
                self._said = True
                why = e if isinstance(e, StorageError) else f"no answer in {self.marks_wait_s:g}s"
                log.warning("retention: health marks not read (%s); the last ones read apply", why)
        return self._last_bad

    def wait(self, timeout_s: float | None = None) -> None:
        """Blocks until the passes scheduled so far have finished.

        Raises:
          TimeoutError: they did not within ``timeout_s``.
        """
        with self._passes:
            asked = self._asked
            if not self._passes.wait_for(lambda: self._done >= asked, timeout_s):
                raise TimeoutError(f"retention: deletions not finished within {timeout_s:g}s")

    def close(self, timeout_s: float | None = None) -> None:
        """Finishes the scheduled deletions and one last pass (waiting at most ``timeout_s``
        in all: a pass still under way then, held up by a store that does not answer, is
        left to the daemon thread, and to the garbage collector if the process exits) and
        stops the deleter. The last pass deletes what waited for a promotion that ended
        after the last commit (another host's step durable: its request went silently)."""
        self.committed()
        with self._passes:
            self._closed = True
            self._passes.notify_all()
            thread = self._thread
        if thread is None:
            return
        thread.join(timeout_s)
        if thread.is_alive():
            log.warning("retention: a pass still under way after %gs is left unfinished", timeout_s)


def _free(tier: Tier) -> int | None:
    """The bytes free on ``tier``'s file system (None: not a file system, or unknown)."""
    free_bytes = getattr(tier.storage, "free_bytes", None)
    try:
        return None if free_bytes is None else int(free_bytes())
    except OSError:
        return None
