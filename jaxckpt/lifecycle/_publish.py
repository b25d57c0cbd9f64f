"""Published weights: chosen committed steps exported as safetensors, in the background.

A manager with ``publish=`` (:class:`~jaxckpt.PublishOptions`) hands every commit of
the primary process to a :class:`Publisher`. A step its policy chooses is recorded as
due (``publish/<step>.due.json`` under the durable root) and queued; one thread
publishes the queue oldest first: it reads the chosen leaves from the committed step on
storage (the nearest tier holding it; never device memory), one block or chunk at a
time under ``max_memory_bytes``, with :func:`~jaxckpt.tools.export_safetensors` (the
path ``jaxckpt export --max-memory`` takes), into ``<destination>/<step>/``: shards
first, ``model.safetensors.index.json`` last. A bucket destination (``s3://``,
``gs://``) gets each shard spooled to a local temporary file and uploaded from it in
parts of at most the budget (S3 multipart, GCS resumable), one shard at a time.
The index says the step is published; the
done record ``publish/<step>.json`` then tells ``jaxckpt ls`` (one listing of
``publish/``) and the due record goes.

Crashes: a publisher killed mid-way leaves the due record and no index (temporary files
at most); the next manager to open the root finds such steps and publishes them again
from the committed step (:meth:`Publisher.recover`). Publishing a step twice writes the
same files, so it is idempotent. The queue is bounded: when a step becomes due while
``queue`` steps wait, the oldest waiting one is skipped (logged, counted, its due record
removed): training is never held up. A failed attempt is retried after a back-off
(``retries`` times); a step that still fails is logged and counted and keeps its due
record; no failure reaches a save.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jaxckpt import policy
from jaxckpt.errors import CheckpointError, StepNotFoundError, UncommittedStepError
from jaxckpt.lifecycle._backoff import Backoff
from jaxckpt.records import PUBLISH, parse_publish_key, publish_key

if TYPE_CHECKING:
    from jaxckpt._options import CheckpointOptions, PublishOptions
    from jaxckpt.records import CommitMarker
    from jaxckpt.storage import Storage
    from jaxckpt.tiers import Tier

log = logging.getLogger("jaxckpt")

PUBLISHED, FAILED, SKIPPED, GONE = "published", "failed", "skipped", "gone"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True, kw_only=True)
class PublishResult:
    """One step's publication: ``outcome`` is published, failed, skipped or gone (the
    step is no longer committed anywhere the publisher reads)."""

    step: int
    outcome: str
    nbytes: int = 0
    seconds: float = 0.0
    error: str | None = None


class Unpublished:
    """The publisher of a manager that publishes nothing."""

    def committed(self, marker: CommitMarker) -> None:
        """Nothing to publish."""

    def pending(self) -> set[int]:
        return set()

    def close(self, timeout_s: float | None = None) -> None:
        """Nothing to stop."""


class _Stopped(Exception):
    """The publisher is closing: the step in progress is left for the next open."""


class _NotDurableYet(CheckpointError):
    """Several processes with a local tier: the step is not on the durable root yet."""


def default_filter(paths: Sequence[str]) -> Callable[[str], bool] | None:
    """The ``params`` subtree when the step has one (a ``TrainState``), else everything."""
    if any(p == "params" or p.startswith("params.") for p in paths):
        return lambda name: name == "params" or name.startswith("params.")
    return None


class Publisher:
    """Publishes chosen committed steps on one background thread (see the module).

    Args:
      options: what, where and when to publish.
      sources: where committed steps are read: ``(root uri, storage options)``, nearest first.
      records: the durable root's storage: the due and done records.
      on_result: told each result (the ledger).
      timeout_s: how long :meth:`close` waits for the queued steps (the manager's
        ``save_timeout_s``).
      several: the job has several processes with a local tier, and ``sources`` is the
        durable root: a step not found there may still be promoted (looked for every few
        seconds, for up to ``timeout_s``; not a failure meanwhile).
      destination_options: an object-store destination's storage options.
    """

    def __init__(
        self,
        options: PublishOptions,
        sources: Sequence[tuple[str, dict[str, Any]]],
        records: Storage,
        *,
        on_result: Callable[[PublishResult], None] | None = None,
        several: bool = False,
        timeout_s: float = 600.0,
        destination_options: Any = None,
    ) -> None:
        self.timeout_s = timeout_s
        self._destination_options = destination_options
        self.options = options
        self._several = several  # several processes: a missing step may not be durable yet
        self._sources = tuple(sources)
        self._records = records
        self._lock = threading.Lock()
        self._on_result = on_result
        self._unreported: deque[PublishResult] = deque(maxlen=64)  # before on_result was set
        self._queue: deque[int] = deque()
        self._current: int | None = None
        self._wake = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._last: tuple[int | None, float | None] = (None, None)
        self._backoff = Backoff(first_s=options.backoff_s[0], longest_s=options.backoff_s[1])
        self.published = self.failures = self.skipped = 0
        """Counts of steps published, failed (after every retry; records too) and skipped."""
        self._thread = threading.Thread(target=self._run, name="jaxckpt-publish", daemon=True)

    # -- the manager's side ------------------------------------------------------------

    def start(self) -> Publisher:
        """Queues the steps a crashed publisher left due, then starts the thread."""
        try:
            self.recover()
        except CheckpointError as e:
            self.failures += 1
            log.error("publish: cannot look for unfinished publications: %s", e)
        self._thread.start()
        return self

    def committed(self, marker: CommitMarker) -> None:
        """A commit of this process (a session listener): publish the step if it is due."""
        step = marker.step
        last_step, last_time = self._last
        ctx = policy.SaveContext(
            step=step, now=time.monotonic(), last_saved_step=last_step, last_save_time=last_time
        )
        if not self.options.policy.should_save(ctx):
            return
        self._last = (step, ctx.now)
        try:
            self._records.write(publish_key(step, due=True), json.dumps({"step": step}).encode())
        except (CheckpointError, OSError) as e:  # the queue still has it; a restart may not
            self.failures += 1
            log.error("publish: cannot record step %d as due: %s", step, e)
        self._enqueue(step)

    def pending(self) -> set[int]:
        """Steps queued or being published (retention keeps them meanwhile)."""
        with self._lock:
            return set(self._queue) | ({self._current} if self._current is not None else set())

    def recover(self) -> list[int]:
        """Queues the due steps without a done record (one listing); returns them."""
        due: set[int] = set()
        done: set[int] = set()
        for key in self._records.list(PUBLISH):
            parsed = parse_publish_key(key)
            if parsed is not None:
                (due if parsed[1] else done).add(parsed[0])
        for step in sorted(due & done):  # published, then killed before the due record went
            self._forget(step)
        todo = sorted(due - done)
        for step in todo:
            self._enqueue(step)
        if todo:
            log.info("publish: resuming the unfinished publication of steps %s", todo)
        return todo

    def close(self, timeout_s: float | None = None) -> None:
        """Waits (up to ``timeout_s``; None: the manager's ``save_timeout_s``) for the queued
        steps, then stops the thread; a step not finished by then stays due and is
        published by the next manager."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        with self._lock:
            while (self._queue or self._current is not None) and self._thread.is_alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._wake.wait(min(left, 1.0))
            self._stop.set()
            self._wake.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=max(1.0, deadline - time.monotonic()))

    # -- the thread --------------------------------------------------------------------

    def _enqueue(self, step: int) -> None:
        skipped = []
        with self._lock:
            if step in self._queue or step == self._current:
                return
            self._queue.append(step)
            while len(self._queue) > self.options.queue:
                skipped.append(self._queue.popleft())
            self.skipped += len(skipped)
            self._wake.notify_all()
        for old in skipped:  # outside the lock: a record deletion may take a request
            log.warning("publish: skipping step %d (step %d is due; still behind)", old, step)
            self._report(PublishResult(step=old, outcome=SKIPPED))
            self._forget(old)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._stop.is_set():
                    self._wake.wait()
                if self._stop.is_set():
                    return
                self._current = self._queue.popleft()
            step = self._current
            try:
                result = self._publish_with_retries(step)
            except _Stopped:
                return
            finally:
                with self._lock:
                    self._current = None
                    self._wake.notify_all()
            self._report(result)

    @property
    def on_result(self) -> Callable[[PublishResult], None] | None:
        """Told each result (the ledger); set late, it is told the results so far first."""
        return self._on_result

    @on_result.setter
    def on_result(self, hook: Callable[[PublishResult], None] | None) -> None:
        with self._lock:
            self._on_result, earlier = hook, list(self._unreported)
            self._unreported.clear()
        for result in earlier:
            self._report(result)

    def _report(self, result: PublishResult) -> None:
        with self._lock:
            hook = self._on_result
            if hook is None:
                self._unreported.append(result)
                return
        with contextlib.suppress(Exception):  # telemetry never stops publishing
            hook(result)

    def _publish_with_retries(self, step: int) -> PublishResult:
        durable_by = time.monotonic() + self.timeout_s
        while True:
            try:
                result = self.publish(step)
            except _Stopped:
                raise
            except _NotDurableYet as e:  # polled (not a failure) until save_timeout_s
                if time.monotonic() > durable_by:
                    self.failures += 1
                    log.error("publish: step %d not durable in time (left due): %s", step, e)
                    return PublishResult(step=step, outcome=FAILED, error=str(e))
                if self._stop.wait(min(self.options.backoff_s[1], 5.0)):
                    raise _Stopped() from e
                continue
            except Exception as e:
                attempts = self._backoff.failures(step) + 1
                if attempts > self.options.retries:
                    self._backoff.succeeded(step)
                    self.failures += 1
                    log.error(
                        "publish: step %d failed after %d attempts (left due for the next "
                        "open): %s",
                        step,
                        attempts,
                        e,
                    )
                    return PublishResult(step=step, outcome=FAILED, error=str(e))
                delay = self._backoff.failed(step)
                log.warning("publish: step %d failed (retried in %.1fs): %s", step, delay, e)
                if self._stop.wait(delay):
                    raise _Stopped() from e
                continue
            self._backoff.succeeded(step)
            return result

    def publish(self, step: int) -> PublishResult:
        """Publishes ``step`` once (no retries): reads it from the nearest source holding it.

        Raises:
          CheckpointError, OSError: the step cannot be read or written (retried).
        """
        from jaxckpt.restoring import open_step
        from jaxckpt.tools import export_safetensors

        start, out = time.monotonic(), self.directory(step)
        local = "://" not in out
        for tmp in glob.glob(os.path.join(glob.escape(out), "*.tmp-*")) if local else ():
            with contextlib.suppress(OSError):  # a killed attempt's
                os.unlink(tmp)
        for uri, storage_options in self._sources:
            try:
                view = open_step(uri, step, **storage_options)
            except (StepNotFoundError, UncommittedStepError):  # not (or not yet) committed there
                continue
            leaves = self.options.tree_filter
            if leaves is None:
                leaves = default_filter([v.path for v in view.arrays()])
            result = export_safetensors(
                uri,
                out,
                step=step,
                leaves=leaves,
                max_shard_bytes=self.options.max_shard_bytes,
                max_memory_bytes=self.options.max_memory_bytes,
                index=True,
                on_progress=self._check_stop,
                out_options=self._destination_options,
                **storage_options,
            )
            seconds = time.monotonic() - start
            done = {
                "step": step,
                "destination": out,
                "files": [os.path.basename(f) for f in result.files],
                "nbytes": result.total_size,
                "seconds": seconds,
                "time": time.time(),
            }
            self._records.write(publish_key(step), json.dumps(done).encode())
            self._forget(step)
            self.published += 1
            log.info(
                "published step %d to %s: %d bytes in %.2fs", step, out, result.total_size, seconds
            )
            return PublishResult(
                step=step, outcome=PUBLISHED, nbytes=result.total_size, seconds=seconds
            )
        if self._several:  # committed on the local tiers, not promoted yet
            raise _NotDurableYet(f"step {step} is not durable under {self._sources[0][0]} yet")
        log.warning("publish: step %d is no longer committed; not published", step)
        self._forget(step)
        return PublishResult(step=step, outcome=GONE)

    def directory(self, step: int) -> str:
        """Where ``step`` is published: ``<destination>/<step>``."""
        if "://" in self.options.destination:  # a bucket (checked and normalised)
            return f"{self.options.destination}/{step}"
        return os.path.join(self.options.destination, str(step))

    def _check_stop(self, nbytes: int) -> None:
        if self._stop.is_set():
            raise _Stopped()

    def _forget(self, step: int) -> None:
        with contextlib.suppress(CheckpointError, OSError):  # a stale due record is redone
            self._records.delete(publish_key(step, due=True))


def open_publisher(tiers: Sequence[Tier], options: CheckpointOptions) -> Publisher | Unpublished:
    """The manager's publisher (started); :class:`Unpublished` without ``publish=``, for a
    read-only manager, and on every process but the primary (it publishes whole steps)."""
    import jax

    publish = options.publish
    if publish is None or options.read_only or jax.process_index() != options.primary_host:
        return Unpublished()
    # Several processes: a local tier holds only this process's part: read the durable root.
    several = jax.process_count() > 1 and len(tiers) > 1
    readable = tiers[-1:] if several else tiers
    sources = [(t.uri, options.storage_kwargs(t.uri)) for t in readable]
    timeout = options.save_timeout_s
    dest = publish.destination
    dest_options = publish.storage_options if "://" in dest else None
    if dest_options is None and "://" in dest:  # the manager's, retried as long as a save
        dest_options = options.storage_kwargs(dest)
    return Publisher(
        publish,
        sources,
        tiers[-1].storage,
        several=several,
        timeout_s=timeout,
        destination_options=dest_options,
    ).start()
