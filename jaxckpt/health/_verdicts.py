"""Step health in a manager: judging saves, marks, skipping bad steps, crash loops, rollback.

The records live on the durable root (:mod:`jaxckpt.records._health` for marks,
:mod:`jaxckpt.records._runs` for restore attempts); only the primary writes them, and
every decision a restore needs is the primary's, agreed with the others (one
:meth:`~jaxckpt.commit._agree.Agreement.agree`). A failure to read or write a record
a save can do without (a verdict, a run record) is logged and counted, never raised
into the save.

* A commit is judged by the health policy from the metrics saved with it and those
  of the earlier good saves; a bad verdict is written as a mark.
* ``restore()`` without a step skips the steps whose newest mark is bad (logging each,
  with its reason); a skipped step may be saved again, which replaces it.
* Crash-loop quarantine: before that choice the primary counts the newest runs that
  restored the same step and ended without progress, clean exit or preemption
  (:func:`jaxckpt.records._runs.crash_loop`); at ``crash_loop_limit`` it marks the step bad.
* ``rollback`` restores the newest good step older than the last one saved or restored.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, overload

import jax

from jaxckpt import _pools, policy
from jaxckpt._options import CheckpointOptions
from jaxckpt.commit import Agreement
from jaxckpt.errors import CorruptCheckpointError, StepNotFoundError
from jaxckpt.records import CommitMarker, RestoredStates
from jaxckpt.records import health_records as _health
from jaxckpt.records import run_records as _runs
from jaxckpt.restoring import Selection
from jaxckpt.storage import STUCK_WRITE_S, Storage

log = logging.getLogger("jaxckpt")

_Restored = tuple[int, Any, RestoredStates]

REASONS_SHOWN = 16
"""How many of the newest bad steps a restore reads the reasons of (for its log)."""
HISTORY = 64
"""Metrics of the newest good saves a health policy sees."""


@dataclass(frozen=True)
class RestorePlan:
    """What the primary decided before a restore, the same on every process."""

    bad: frozenset[int] = frozenset()
    marks: Mapping[int, _health.MarkKey] = field(default_factory=dict)
    """The primary's listing of the newest marks (empty on the others)."""
    explicit: int | None = None
    hooks: Mapping[str, Any] = field(default_factory=dict)
    """``Selection.restore``'s ``skip`` (without a step) and ``attempting``."""


class _Lazy(Sequence[Mapping[str, float]]):
    """The metrics of earlier saves, loaded when a policy first looks at them."""

    def __init__(self, load: Callable[[], list[Mapping[str, float]]]) -> None:
        self._load = load
        self._items: list[Mapping[str, float]] | None = None

    @property
    def loaded(self) -> bool:
        return self._items is not None

    def _get(self) -> list[Mapping[str, float]]:
        if self._items is None:
            self._items = self._load()
        return self._items

    def __len__(self) -> int:
        return len(self._get())

    @overload
    def __getitem__(self, i: int) -> Mapping[str, float]: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Mapping[str, float]]: ...
    def __getitem__(self, i: int | slice) -> Any:
        return self._get()[i]


class Health:
    """The health side of one manager.

    Args:
      storage: the durable root's storage (marks and run records live there).
      selection: the manager's restore selection (its steps, its replaceable set).
      agreement: the manager's.
      options: ``health`` and ``crash_loop_limit``; ``read_only`` writes nothing.

    While the durable root has not answered since the open (see
    :mod:`jaxckpt.tiers._durablejoin`) the records are skipped and no step is bad
    (unknown health is good health), said once.
    """

    def __init__(
        self,
        storage: Storage,
        selection: Selection,
        agreement: Agreement,
        options: CheckpointOptions,
    ) -> None:
        self._storage = storage
        self._answers = selection.tiers[-1].answers  # see tiers._durablejoin
        self._select = selection
        self._agreement = agreement
        self._policy = None if options.health is None else policy.health_from(options.health)
        self._limit: int | None = options.crash_loop_limit
        self._primary = jax.process_index() == agreement.primary
        self._writes = self._primary and not options.read_only
        self._lock = threading.Lock()
        self._history: list[Mapping[str, float]] | None = None
        self._replaced: set[int] = set()  # bad steps a save may replace (judged afresh)
        self._run: str | None = None  # set at the first restore of a writable manager
        self._exit_write: Future[None] | None = None  # the exit record's write (see ended)
        self._exit_wait_s, self._exit_failed = options.close_wait_s, False
        self._recording = False  # inside the first restore: its attempts are recorded
        self._listed_runs: list[_runs.Run] | None = None  # the quarantine's listing
        self.skipped: frozenset[int] = frozenset()
        """The bad steps the last restore's plan skips (the ledger says why it went back)."""
        self.quarantined: int | None = None
        """The step this manager's crash-loop check marked bad, if any."""
        self._marked: set[int] | None = None  # the steps with marks, at the last bad_steps()
        self._restored: int | None = None
        self._progress = False
        self._exited = False
        self.position: int | None = None
        """The step last committed here or restored (where ``rollback`` goes back from)."""
        self.failures = 0
        """Records that could not be read or written (each logged)."""
        self._said_skipped = False

    # -- saves -------------------------------------------------------------------

    def committed(self, marker: CommitMarker) -> None:
        """A commit of this process (a session listener): judge it, note progress."""
        self.position = marker.step  # the primary's is agreed by rollback
        if not self._writes or self._skipped(f"the health of step {marker.step}"):
            return
        try:
            self._judge(marker)
            with self._lock:
                restored = -1 if self._restored is None else self._restored
                progress = self._run is not None and not self._progress
                progress = progress and marker.step > restored
                self._progress |= progress
            if progress and self._run is not None:  # not waited for: see _detached
                what = f"the progress record of step {marker.step}"
                self._detached(what, _runs.write_progress, self._storage, self._run, marker.step)
        except Exception as e:  # the save committed; its verdict is an extra
            self._failed(f"health of step {marker.step}", e)

    def _judge(self, marker: CommitMarker) -> None:
        if self._policy is None:
            return
        metrics, step = dict(marker.metrics), marker.step
        known = self._history
        history = _Lazy(lambda: self._seed(step)) if known is None else _Lazy(lambda: known)
        reason = self._policy.check(marker.step, metrics, history)
        replaced = marker.step in self._replaced
        if reason is not None or replaced:
            verdict = reason or "saved again after it was skipped"
            mark = _health.mark_now(marker.step, reason is None, verdict, "policy")
            _health.write_mark(self._storage, mark)
            self._replaced.discard(marker.step)
        if reason is not None:
            log.warning("step %d is bad: %s (restore() will skip it)", marker.step, reason)
            return
        if history.loaded:  # else the steps committed since are read when first needed
            self._history = [*history, metrics][-HISTORY:]

    def _seed(self, below: int) -> list[Mapping[str, float]]:
        """The metrics of the newest committed good steps before ``below`` (read once per
        manager, and only by a policy that looks at earlier steps)."""
        try:
            tier = self._select.tiers[0]
            bad = _health.bad_steps(self._storage)
            committed = {s: m for s, m in tier.committed().items() if s < below}
            steps = [s for s in sorted(committed)[-HISTORY:] if s not in bad]
            return [dict(committed[s].metrics) for s in steps if committed[s].metrics]
        except Exception as e:
            self._failed("the metrics of earlier steps", e)
            return []

    # -- marks -------------------------------------------------------------------

    def mark(self, step: int, good: bool, reason: str) -> None:
        """Writes a mark by hand (the primary does; others return)."""
        if not self._primary:
            return
        if not any(t.holds(step) for t in self._select.tiers):
            raise StepNotFoundError(f"no committed step {step} under {self._storage.uri} to mark")
        _health.write_mark(self._storage, _health.mark_now(step, good, reason, "mark"))
        log.info("marked step %d %s: %s", step, "good" if good else "bad", reason or "-")

    def bad_steps(self) -> set[int]:
        """The steps whose newest mark is bad (one listing; raises on a storage error; none
        while the durable root does not answer)."""
        if not self._answers():
            return set()
        marks = _health.list_marks(self._storage)
        self._marked = set(marks)
        return {s for s, k in marks.items() if not k.good}

    def deleted(self, step: int) -> None:
        """``step`` was deleted from the durable root: its marks go (a step saved again
        under that number starts unknown). Retention tells it after :meth:`bad_steps`,
        so only a step with marks costs requests."""
        if self._writes and (self._marked is None or step in self._marked):
            try:
                _health.drop_marks(self._storage, step)
            except Exception as e:
                self._failed(f"the marks of deleted step {step}", e)

    # -- restores ----------------------------------------------------------------

    def plan(self, step: int | None, *, restoring: bool = True) -> RestorePlan:
        """The primary's decision before a restore of ``step`` (None: the newest good
        one; collective): the bad steps, after a crash-loop quarantine if one is due,
        and the reasons of the newest ones. ``restoring=False``: only the bad steps."""
        self._select.catch_up()  # the durable root's epoch, if it answered since the open
        bad: list[int] = []
        marks: dict[int, _health.MarkKey] = {}
        if restoring:
            self._recording = self._writes and self._limit is not None and self._run is None
        if restoring and not self._answers():
            self._recording = False  # no run record: this run counts toward no crash loop
        if self._primary and not self._skipped("the health marks"):
            try:
                keys = self._storage.list(_health.HEALTH)  # marks and runs: one listing
                marks = _health.newest_marks(keys)
                if step is None and restoring:
                    marks = self._quarantine(marks, keys)
                bad = sorted(s for s, k in marks.items() if not k.good)
            except Exception as e:  # unknown health is good health: restore as before
                self._failed("the health marks", e)
        bad = self._agreement.agree("health", bad)
        hooks = {"skip": frozenset(bad) if step is None else (), "attempting": self.attempting}
        self.skipped = frozenset(bad) if step is None else frozenset()
        return RestorePlan(frozenset(bad), marks, step, hooks)

    def _reasons(self, plan: RestorePlan, steps: list[int]) -> dict[int, str]:
        """Why each of ``steps`` (bad ones) is bad: the primary reads the newest
        :data:`REASONS_SHOWN` records; the others say "marked bad"."""
        reasons = dict.fromkeys(steps, "marked bad")
        for s in sorted((s for s in steps if s in plan.marks), reverse=True)[:REASONS_SHOWN]:
            reasons[s] = _health.read_mark(self._storage, plan.marks[s]).reason or "marked bad"
        return reasons

    def _quarantine(
        self, marks: dict[int, _health.MarkKey], keys: list[str]
    ) -> dict[int, _health.MarkKey]:
        """Marks the step of a crash loop bad (the primary, before a restore)."""
        if self._limit is None or not self._recording:  # only a run's first restore
            return marks
        self._listed_runs = _runs.parse_runs(keys)
        since = lambda s: marks[s].stamp if s in marks else ""  # noqa: E731
        step, n = _runs.crash_loop(self._listed_runs, since)
        if step is None or n < self._limit or (step in marks and not marks[step].good):
            return marks
        reason = f"crash loop: restored {n} times without progress"
        log.error("step %d: %s; marking it bad and restoring an older step", step, reason)
        key = _health.write_mark(self._storage, _health.mark_now(step, False, reason, "crash-loop"))
        parsed = _health.parse_mark_key(key)
        assert parsed is not None  # a key write_mark made
        self.quarantined = step
        return {**marks, step: parsed}

    def attempting(self, step: int) -> None:
        """The restore is about to read ``step``: the first restore of a writable manager
        records it (the primary), before any data is read."""
        with self._lock:
            if not self._recording or self._restored == step:
                return
            first, self._restored = self._run is None, step
            if first:
                self._run = _runs.new_run()
            run = self._run
        assert run is not None
        try:
            if first:
                listed = self._listed_runs
                listed = _runs.list_runs(self._storage) if listed is None else listed
                _runs.prune_runs(self._storage, listed, _runs.KEEP_RUNS - 1)
            else:  # the first restore fell back to an older step: record that one instead
                self._storage.delete_prefix(f"{_runs.RUNS}{run}/")
            _runs.write_restore(self._storage, run, step)
        except Exception as e:
            self._failed("the restore record", e)

    def restored(self, plan: RestorePlan, restored: _Restored) -> _Restored:
        """A restore returned ``restored`` (its step first): logs what it skipped (a save
        may replace those); returns ``restored``."""
        step = restored[0]
        self.position, self._recording = step, False
        if plan.explicit is not None:
            if step in plan.bad:
                why = self._reasons(plan, [step])[step]
                log.warning("restoring step %d although it is marked bad: %s", step, why)
            return restored
        skipped = sorted((s for s in plan.bad if s > step), reverse=True)
        for s, why in self._reasons(plan, skipped).items():
            log.warning("restore skipped step %d: %s", s, why)
        self._replaced |= set(skipped)
        self._select.corrupt |= set(skipped)  # a save of such a step replaces it
        return restored

    # -- ends of a run -----------------------------------------------------------

    def ended(self, how: str | None, timeout_s: float | None = None) -> bool:
        """Records how this run ended, ``"clean"`` or ``"preempted"`` (None: neither);
        once, and only for a run that restored. The write goes on in the background: the
        call that starts it waits at most ``close_wait_s``, a call with ``timeout_s`` (a
        close) at most that and at most ``STUCK_WRITE_S``. One not written then (a store
        that does not answer) is counted once, and abandoned at exit; False then."""
        with self._lock:
            run, starts = self._run, False
            if how is not None and not self._exited and run is not None and self._writes:
                self._exited = starts = True
                self._exit_write = _pools.detached(
                    "exit-record", _runs.write_exit, self._storage, run, how
                )
            writing = self._exit_write
        if writing is None or (timeout_s is None and not starts):
            return True
        wait_s = self._exit_wait_s if timeout_s is None else min(timeout_s, STUCK_WRITE_S)
        try:
            writing.result(wait_s)
        except Exception as e:
            if not self._exit_failed:
                self._exit_failed = True
                why = TimeoutError(f"not written within {wait_s:g}s")
                self._failed("the exit record", why if isinstance(e, TimeoutError) else e)
            return False
        return True

    # -- rollback ----------------------------------------------------------------

    def rollback(self, restore: Callable[[int], Any], steps: list[int]) -> Any:
        """Restores the newest good step of ``steps`` (the agreed listing) older than
        :attr:`position`, trying older ones after a corrupt one; the newer steps are
        marked bad (``rollback``) and may be saved again.

        Raises:
          StepNotFoundError: no good step is older than the position.
        """
        below = self._agreement.agree("rollback-from", self.position)
        if below is None:
            raise StepNotFoundError(
                f"rollback under {self._storage.uri}: nothing was saved or restored yet"
            )
        bad = self.plan(below, restoring=False).bad
        good = [s for s in steps if s < below and s not in bad]
        for target in reversed(good):
            try:
                state = restore(target)
            except CorruptCheckpointError as e:
                log.warning("rollback: step %d is corrupt (%s); trying an older one", target, e)
                continue
            self._roll_back_past(target, [s for s in steps if s > target], bad)
            return state
        raise StepNotFoundError(
            f"rollback under {self._storage.uri}: no good committed step older than {below} "
            f"(steps: {steps}; marked bad: {sorted(bad)})"
        )

    def _roll_back_past(self, target: int, newer: list[int], bad: frozenset[int]) -> None:
        """The steps newer than ``target`` are bad now, and a save may replace them."""
        log.warning("rolled back to step %d; steps %s are marked bad", target, newer or "-")
        self._replaced |= set(newer)
        self._select.corrupt |= set(newer)
        if not self._writes:
            return
        for s in (s for s in newer if s not in bad):
            try:
                reason = f"rolled back to step {target}"
                _health.write_mark(self._storage, _health.mark_now(s, False, reason, "rollback"))
            except Exception as e:
                self._failed(f"the rollback mark of step {s}", e)

    def _skipped(self, what: str) -> bool:
        """True (said once per manager) while the durable root does not answer."""
        if self._answers():
            return False
        if not self._said_skipped:
            self._said_skipped = True
            log.warning(
                "durable root %s does not answer yet: %s and the other health records are "
                "skipped until it does",
                self._storage.uri,
                what,
            )
        return True

    def _detached(self, what: str, write: Callable[..., Any], *args: Any) -> None:
        """Runs ``write`` in the background, a failure counted: a save does not wait for
        a record (a storm held a save up for the retries of its progress record)."""

        def told(done: Future[Any]) -> None:
            error = done.exception()
            if isinstance(error, Exception):
                self._failed(what, error)

        _pools.detached("health-record", write, *args).add_done_callback(told)

    def _failed(self, what: str, e: Exception) -> None:
        self.failures += 1
        log.error("could not read or write %s under %s: %s", what, self._storage.uri, e)
