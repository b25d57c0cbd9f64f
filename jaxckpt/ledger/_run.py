"""The manager's side of the run ledger: what it observes, and when it is written.

A :class:`RunLedger` is made first thing when a manager opens (:meth:`RunLedger.starting`:
the open's start time, and the compilation cache when asked for) and joined to the
manager's parts once they exist (:meth:`opened`). The manager's collective methods
then run through :meth:`call`: ``save`` notes the reached step (every call, also
those the policy declines: a compare and an assignment), the first save call and a
preemption notice, and after it returns, the saves committed since (taken from the
session's :class:`~jaxckpt.saving._telemetry.SaveRecorder`, which holds their figures);
``restore`` times the restore and notes the step, the tier and why an older step was
taken; ``close`` records the exit (with the error when it runs while an exception
unwinds the loop, e.g. from ``__exit__``: a failed run). Promotions, retention deletions
and published weights come through hooks of those components. Everything is buffered by a
:class:`~jaxckpt.ledger._writer.LedgerWriter` and written by its thread, never by
a save; metrics go out through :class:`~jaxckpt.ledger._monitor.Monitor`.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from jaxckpt.ledger._events import LedgerObject
from jaxckpt.ledger._executables import ExecutableCache
from jaxckpt.ledger._monitor import Monitor
from jaxckpt.ledger._startup import cache_dir, enable_compilation_cache, process_start_time
from jaxckpt.ledger._writer import LedgerWriter

if TYPE_CHECKING:
    from jaxckpt._options import CheckpointOptions
    from jaxckpt.records import CommitMarker, PromotionResult
    from jaxckpt.saving import FailedSaves, SaveRecorder
    from jaxckpt.tiers import Tier

log = logging.getLogger("jaxckpt")

_OBSERVED = frozenset({"save", "restore", "close"})
_T = TypeVar("_T")


class _Session(Protocol):
    @property
    def failures(self) -> FailedSaves: ...
    @property
    def recorder(self) -> SaveRecorder: ...
    def listen(self, *listeners: Any) -> None: ...


class ManagerParts(Protocol):
    """What the ledger reads of a :class:`jaxckpt.CheckpointManager` (read only; the
    promotion's ``on_result``, the retention's ``on_deleted`` and the session's
    ``failures.on_failed`` hooks it sets)."""

    @property
    def options(self) -> CheckpointOptions: ...
    @property
    def restored_step(self) -> int | None: ...
    @property
    def _tiers(self) -> tuple[Tier, ...]: ...
    @property
    def _session(self) -> _Session: ...
    @property
    def _promotion(self) -> Any: ...
    @property
    def _retention(self) -> Any: ...
    @property
    def _watcher(self) -> Any: ...
    @property
    def _select(self) -> Any: ...


class RunLedger:
    """The run ledger of one manager (see the module docstring).

    Attributes:
      write_failures: ledger writes that failed (logged; none fails a save).
    """

    def __init__(self, root: str, options: CheckpointOptions) -> None:
        self.open_start = time.time()
        self.process_start = process_start_time()
        self._options = options
        self._on = options.ledger and not options.read_only
        self.executables: ExecutableCache | None = None  # CheckpointManager.compile's
        if options.compilation_cache:
            import jax

            directory = cache_dir(root, options.local_root)
            self.executables = ExecutableCache(directory)
            if options.local_root is not None and jax.process_count() > 1:
                log.info(
                    "compilation cache in the local tier: CheckpointManager.compile keeps each "
                    "process's step; JAX's cache is left off (it writes from process 0 alone, "
                    "so it would serve process 0 only)"
                )
            else:
                enable_compilation_cache(directory)
        self._writer: LedgerWriter | None = None
        self._monitor = Monitor(primary=False, metrics_port=None)
        self._parts: ManagerParts | None = None
        self._lock = threading.Lock()
        self._returned: set[int] = set()  # save() returned; its stats not yet logged
        self._logged: set[int] = set()
        self._marker_bytes: dict[int, int] = {}  # committed here: the marker's bytes
        self._first_save = True
        self._preempted = False
        self._primary = False
        self._closed = False
        self.closing_by: float | None = None
        """Set by the manager's ``close()`` (``time.monotonic()``): the last flush waits at
        most until then (``CheckpointOptions.close_wait_s`` shared with the other records)."""

    @classmethod
    def starting(cls, root: str | os.PathLike[str], options: CheckpointOptions) -> RunLedger:
        """Made first thing when a manager opens (its open's start time)."""
        return cls(os.fspath(root), options)

    def close_wait_s(self) -> float:
        """How long ``close()`` waits for what a run can do without: ``close_wait_s``, or at
        most :data:`OUTAGE_WAIT_S` while the ledger's writes find the durable root not
        answering (a job ending in a storm waited its whole ``close_wait_s`` for nothing)."""
        wait_s = self._options.close_wait_s
        if self._writer is None or self._writer.answering or wait_s <= OUTAGE_WAIT_S:
            return wait_s
        log.warning(
            "durable root does not answer the ledger's writes: close() waits at most %gs for "
            "the run's last records (close_wait_s=%g)",
            OUTAGE_WAIT_S,
            wait_s,
        )
        return OUTAGE_WAIT_S

    def unanswered(self) -> float:
        """A write of the close found the durable root not answering: the rest of the close
        waits at most :data:`OUTAGE_WAIT_S` more. Returns the close's new deadline."""
        by = time.monotonic() + OUTAGE_WAIT_S
        self.closing_by = by if self.closing_by is None else min(self.closing_by, by)
        return self.closing_by

    @property
    def write_failures(self) -> int:
        return 0 if self._writer is None else self._writer.failures

    @property
    def writer(self) -> LedgerWriter | None:
        """The writer (None: no ledger, e.g. a read-only manager)."""
        return self._writer

    def compile(self, lowered: Any) -> Any:
        """``lowered.compile()``, kept per process with ``compilation_cache``; its outcome
        and seconds are an event (``compile``)."""
        began = time.monotonic()
        cache = self.executables
        compiled = lowered.compile() if cache is None else cache.compile(lowered)
        outcome = "compiled" if cache is None else cache.outcome or "compiled"
        seconds = time.monotonic() - began
        if self._writer is not None:
            self._writer.append("compile", outcome=outcome, seconds=seconds)
        self._monitor.compiled(outcome, seconds)
        return compiled

    def opened(self, parts: ManagerParts) -> None:
        """Joins the opened manager's parts and starts writing (a writable manager)."""
        durable = parts._tiers[-1]
        epoch = durable.protocol.epoch
        if not self._on or (epoch is None and not durable.deferred):
            return
        import jax

        self._parts = parts
        options = parts.options
        self._primary = jax.process_index() == options.primary_host
        self._monitor = Monitor(primary=self._primary, metrics_port=options.metrics_port)
        writer = LedgerWriter(
            durable.storage,
            epoch=epoch,
            process=jax.process_index(),
            processes=jax.process_count(),
            interval_s=options.ledger_flush_s,
            before_flush=self._harvest,
        )
        now = time.time()
        writer.append(
            "open",
            t=now,
            process_start=self.process_start,
            open_start=self.open_start,
            tiers=[t.name for t in parts._tiers],
            pid=os.getpid(),
        )
        self._startup("open", now)
        if hasattr(parts._promotion, "on_result"):
            parts._promotion.on_result = self._promoted
        parts._retention.on_deleted = self._deleted
        parts._session.failures.on_failed = lambda step, error: writer.append(
            "save_failed", step=step, error=error
        )
        parts._session.listen(self)
        durable.on_adopt(writer.adopt)  # deferred: the events wait for the epoch
        self._writer = writer
        publisher: Any = getattr(parts, "_publisher", None)
        if hasattr(publisher, "on_result"):  # publishes weights (results so far come now)
            publisher.on_result = self._published
        _open_at_exit(self)
        writer.start()

    def _startup(self, phase: str, now: float) -> None:
        if self.process_start is not None:
            self._monitor.startup(phase, now - self.process_start)

    def call(self, kind: str, step: int | None, method: Callable[[], _T]) -> _T:
        """Runs ``method``, one of the manager's collective methods (``kind``), observing it.

        A ``save`` call the policy declines costs a clock read and two assignments.
        """
        writer, parts = self._writer, self._parts
        if writer is None or parts is None or kind not in _OBSERVED or self._closed:
            return method()
        now = time.time()
        if kind == "save" and step is not None:
            self._save_called(writer, parts, step, now)
        unwinding = sys.exc_info()[1] if kind == "close" else None  # close() from __exit__
        try:
            result = method()
        except Exception as e:
            if kind == "save":
                writer.append("save_failed", step=step, error=f"{type(e).__name__}: {e}")
            raise
        finally:
            if kind == "close":
                self._close(closed=True, error=unwinding)
        if kind == "save" and result is True and step is not None:
            writer.append("save_call", step=step, seconds=time.time() - now)
            with self._lock:
                self._returned.add(step)
        if kind == "save" and self._returned:
            self._harvest()
        elif kind == "restore":
            self._restored(writer, parts, time.time() - now)
        return result

    def _save_called(
        self, writer: LedgerWriter, parts: ManagerParts, step: int, now: float
    ) -> None:
        if self._primary:
            writer.reached(step, now)
            self._monitor.reached(step)
        if self._first_save:
            self._first_save = False
            writer.append("first_save", t=now, step=step)
            self._startup("first_save", now)
        watcher = parts._watcher
        if not self._preempted and watcher is not None and watcher.noticed:
            self._preempted = True
            writer.append("preemption", t=now, step=step)

    def _harvest(self) -> None:
        """Logs the saves committed since the last look whose ``save()`` has returned."""
        writer, parts = self._writer, self._parts
        if writer is None or parts is None:
            return
        with self._lock:
            if not self._returned:
                return
            history = parts._session.recorder.history()
            tier = parts._tiers[0].name
            for stats in history:
                if stats.step not in self._returned or stats.step in self._logged:
                    continue
                nbytes = self._marker_bytes.pop(stats.step, None)
                if nbytes is None:  # its commit is being announced: the next look logs it
                    continue
                self._returned.discard(stats.step)
                self._logged.add(stats.step)
                writer.append(
                    "save",
                    step=stats.step,
                    blocking_s=stats.blocking_s,
                    total_s=stats.total_s,
                    nbytes=nbytes,
                    tier=tier,
                    started=stats.started,
                )
                self._monitor.saved(stats.step, stats.blocking_s, stats.total_s, stats.nbytes)
            recent = {s.step for s in history}
            self._logged &= recent
            for step in [s for s in self._marker_bytes if s not in recent]:
                del self._marker_bytes[step]  # never returned from save() here (bounded)
            self._monitor.failures(writer.failures)

    def _restored(self, writer: LedgerWriter, parts: ManagerParts, seconds: float) -> None:
        step = parts.restored_step
        if step is None:
            return
        known = parts._select.restored_from  # what the restore read: no request here
        tier, newest, nbytes = known[1:] if known and known[0] == step else (None, None, 0)
        why = None
        if newest is not None and newest > step:
            why = "fallback" if newest in parts._select.corrupt else "healing"
            if len(parts._tiers) == 1:
                why = "fallback"
            health = getattr(parts, "_health", None)  # bad steps skipped: marked or quarantined
            if health is not None and any(step < s <= newest for s in health.skipped):
                why = "quarantine" if health.quarantined in health.skipped else "bad"
        now = time.time()
        writer.append(
            "restore",
            t=now,
            step=step,
            tier=tier,
            seconds=seconds,
            newest=newest,
            why=why,
            nbytes=nbytes,
        )
        self._monitor.restored(step, seconds, nbytes, why)
        if self._primary:  # the previous run's reached step is read off the restore's path
            args = (self._monitor, parts._tiers[-1], writer, step)
            threading.Thread(target=_tell_lost, args=args, name="jaxckpt-lost", daemon=True).start()
        self._startup("restored", now)

    def committed(self, marker: CommitMarker) -> None:
        """A commit of this process (the session's listener): the step's bytes."""
        with self._lock:
            self._marker_bytes[marker.step] = marker.nbytes

    def _promoted(self, result: PromotionResult) -> None:
        writer, parts = self._writer, self._parts
        if writer is None or parts is None or result.outcome != "promoted":
            return
        started = next(
            (s.started for s in parts._session.recorder.history() if s.step == result.step), None
        )
        durable_s = None
        if started and result.durable_time is not None:
            durable_s = max(0.0, result.durable_time - started)
            self._monitor.promoted(durable_s)
        writer.append(
            "promoted",
            step=result.step,
            nbytes=result.nbytes,
            seconds=result.seconds,
            durable_s=durable_s,
        )

    def _published(self, result: Any) -> None:  # a lifecycle PublishResult
        if self._writer is not None:
            self._writer.append(
                "publish",
                step=result.step,
                outcome=result.outcome,
                nbytes=result.nbytes,
                seconds=result.seconds,
                error=result.error,
            )

    def _deleted(self, tier: str, step: int, nbytes: int) -> None:
        if self._writer is not None:
            self._writer.append("deleted", step=step, tier=tier, nbytes=nbytes)
            self._monitor.deleted(nbytes)

    def _close(
        self, *, closed: bool, error: BaseException | None = None, timeout_s: float | None = None
    ) -> None:
        writer = self._writer
        if writer is None or self._closed:
            return
        if timeout_s is None:
            by = self.closing_by
            wait_s = self._options.close_wait_s
            timeout_s = wait_s if by is None else max(0.0, by - time.monotonic())
        self._closed = True
        self._harvest()
        text = None if error is None else f"{type(error).__name__}: {error}"
        writer.append("exit", closed=closed, error=text)
        writer.close(timeout_s)
        self._monitor.close()
        _OPEN.discard(self)


OUTAGE_WAIT_S = 1.0
"""What ``close()`` waits in all for the run's last records while the durable root does
not answer (:meth:`RunLedger.close_wait_s`)."""
_OPEN: weakref.WeakSet[RunLedger] = weakref.WeakSet()
AT_EXIT_S = 5.0
"""How long interpreter exit waits for the last flushes of managers left open (all together)."""


def _open_at_exit(ledger: RunLedger) -> None:
    if not _OPEN:
        atexit.unregister(_at_exit)
        atexit.register(_at_exit)
    _OPEN.add(ledger)


def _at_exit() -> None:
    """The interpreter exits with managers open: their processes ended by themselves. Their
    last flushes run at once, bounded together (their stores may be gone by now)."""
    deadline = time.monotonic() + AT_EXIT_S
    threads = [
        threading.Thread(
            target=lambda x=x: x._close(closed=False, timeout_s=AT_EXIT_S), daemon=True
        )
        for x in list(_OPEN)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))


def _tell_lost(monitor: Monitor, durable: Tier, writer: LedgerWriter, step: int) -> None:
    """Tells ``monitor`` the previous run's reached step minus ``step``, from its primary's
    last ledger objects (a listing and a GET or two); nothing when unknown."""
    epoch, primary = writer.epoch, writer.process
    if epoch is None:  # the durable root has not answered yet
        return
    try:
        keys = durable.storage.list(f"ledger/{epoch - 1:012d}/{primary:06d}/")
        for key in reversed(keys[-3:]):
            data = durable.storage.read(key)
            obj = None if data is None else LedgerObject.from_bytes(key, data)
            reached = [e["step"] for e in (obj.events if obj else ()) if e["kind"] == "reached"]
            if reached:
                monitor.lost(max(0, reached[-1] - step))
                return
    except Exception as e:  # a metric only
        log.debug("ledger: the previous run's reached step is unknown: %s", e)
