"""Retention: one background deleter for every tier of a manager.

After each commit (and each promotion) the deleter applies each tier's rule
(``local_retention`` on a local tier, ``retention`` on the durable one) on
one thread. A step is never deleted while it is *protected*: being restored,
being saved, or waiting for promotion (the newest ``promote_backlog`` of those, see
``lifecycle._waiting``). An own tier is pruned by every host,
a shared tier by the primary only. Deletions are fence-checked by the tier's
protocol; a fenced deleter reports the fence and stops.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from jaxckpt import policy
from jaxckpt.errors import StorageError, WriterFencedError
from jaxckpt.lifecycle._keep import retention_decision
from jaxckpt.records import CommitMarker
from jaxckpt.tiers import Tier

log = logging.getLogger("jaxckpt")


class Retention:
    """Applies every tier's retention rule in the background.

    Args:
      tiers: the manager's tiers, nearest first.
      primary: this process prunes the shared tiers.
      protected: callables naming steps to keep whatever the rule says (the
        step in flight, the steps awaiting promotion); restoring steps are
        added by :meth:`restoring`.
      on_fenced: told when a deletion finds that a newer writer took over.
      bad: the steps marked bad; the newest step of a tier not among them is kept.
      deleted: told of each step deleted from the last (durable) tier (its marks go).
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
    ) -> None:
        self._tiers = tuple(tiers)
        self._bad = bad
        self._last_bad: set[int] = set()  # the marks last read (kept through an outage)
        self._said = False
        self._deleted = deleted
        self._primary = primary
        self._protected = tuple(protected)
        self._on_fenced = on_fenced
        self._lock = threading.Lock()
        self._restoring: set[int] = set()
        self._pool: ThreadPoolExecutor | None = None
        self._deletion: Future[None] | None = None
        self._closed = False
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

    def protected(self) -> set[int]:
        """Steps no rule may delete now: restoring ∪ in flight ∪ awaiting promotion."""
        with self._lock:
            steps = set(self._restoring)
        for source in self._protected:
            steps |= source()
        return steps

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
        with self._lock:
            if self._closed:  # a promotion finishing after close() is pruned next time
                return
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="jaxckpt-retention")
            self._deletion = self._pool.submit(self.apply)

    def apply(self) -> None:
        """Deletes, in every tier this process prunes, what its rule does not keep."""
        try:
            for tier in self._tiers:
                if tier.retention is None or not tier.prunes(primary=self._primary):
                    continue
                committed = tier.committed()
                protected, bad = self.protected(), self._bad_now()
                rule = retention_decision(committed, tier.retention, protected=protected, bad=bad)
                for step in rule.delete:
                    log.info("retention: deleting step %d under %s", step, tier.uri)
                    tier.delete(step)
                    if tier is self._tiers[-1]:
                        self._deleted(step)
                    if self.on_deleted is not None:
                        self.on_deleted(tier.name, step, committed[step].nbytes)
        except WriterFencedError as e:
            self._on_fenced(e)
            log.error("retention stopped: %s", e)
        except Exception:
            log.exception("retention failed; it will be retried after the next save")

    def _bad_now(self) -> set[int]:
        """The bad steps; while the durable root (where marks live) does not answer, those
        last read: local retention goes on in an outage (it stopped, and a 503 storm
        filled a node's disk with every step saved meanwhile)."""
        try:
            self._last_bad, self._said = self._bad(), False
        except StorageError as e:
            if not self._said:  # once an outage
                self._said = True
                log.warning("retention: health marks not read (%s); the last ones read apply", e)
        return self._last_bad

    def wait(self, timeout_s: float | None = None) -> None:
        """Blocks until the scheduled deletions have finished."""
        deletion = self._deletion
        if deletion is not None:
            deletion.result(timeout=timeout_s)

    def close(self) -> None:
        """Finishes the scheduled deletions and stops the deleter."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
