"""CheckpointManager: the public entry point; it builds the parts and delegates to them.

The manager holds its tiers (:mod:`jaxckpt.tiers`, nearest first), the save session
(:class:`~jaxckpt.saving.SaveSession`), retention and promotion
(:mod:`jaxckpt.lifecycle`), the restore selection (:class:`~jaxckpt.restoring.Selection`),
the agreement among hosts and the preemption watcher. A save goes manager →
``SaveSession.save`` → Orbax's ``AsyncCheckpointer`` → ``ZarrHandler.async_save``
(the host snapshot) and, on Orbax's background thread, ``SaveSession.write`` →
``StepWrite.run`` → the layout's :class:`~jaxckpt.formats.StepWriter` (chunks), then
the agreed commit (marker); a restore goes manager → ``Selection.restore`` →
``StepReader.restore`` (:func:`~jaxckpt.restoring.tier_reader`).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

import jax

from jaxckpt import _openroots
from jaxckpt._options import CheckpointOptions
from jaxckpt._preemption import PreemptionWatcher
from jaxckpt.commit import Agreement
from jaxckpt.errors import CheckpointError
from jaxckpt.health import Health, HealthAccess
from jaxckpt.ledger import RunLedger
from jaxckpt.lifecycle import Retention, open_promotion, open_publisher
from jaxckpt.records import ProcessStateAccess
from jaxckpt.restoring import PathMap, Selection, StepMetadata, step_metadata
from jaxckpt.saving import SaveSession, SaveStats, StepClock, check_step_value
from jaxckpt.tiers import Tier, join_tiers, open_tiers
from jaxckpt.tools import VerifyReport, verify_step

log = logging.getLogger("jaxckpt")

_F = TypeVar("_F", bound=Callable[..., Any])


_check_step = check_step_value


def _collective(kind: str) -> Callable[[_F], _F]:
    """Runs a collective method in its own operation of the manager's agreement (keys by
    the operation, and for a save by the step): hosts that failed at different points
    of one operation meet again at the next."""

    def wrap(method: _F) -> _F:
        @functools.wraps(method)
        def run(self: CheckpointManager, *args: Any, **kwargs: Any) -> Any:
            key = None
            if kind == "save" and not isinstance(args[0] if args else None, jax.Array):
                try:
                    key = _check_step(args[0] if args else kwargs["step"])
                except (ValueError, KeyError, IndexError):
                    key = None  # the method raises it
            with self._agreement.operation(kind, key):
                return self.ledger.call(kind, key, lambda: method(self, *args, **kwargs))

        return run  # type: ignore[return-value]

    return wrap


def _left(by: float) -> float:
    """Seconds until ``by`` (``time.monotonic()``), at least 0."""
    return max(0.0, by - time.monotonic())


class CheckpointManager(ProcessStateAccess, HealthAccess):
    """Saves and restores checkpoints of a JAX pytree under one root.

    Saves are asynchronous: ``save`` returns once the state is in host memory; the data is
    written in the background and is visible once its commit marker is. One save in flight.

    With ``local_root``, saves commit to the fast local tier and ``promote_policy``'s steps are
    promoted to ``root`` in the background or by a ``jaxckpt promote`` sidecar (README).

    Args:
      root: a local path, ``file://`` URI, ``gs://bucket/prefix`` or ``s3://bucket/prefix``.
      options: a :class:`CheckpointOptions`; keyword arguments override its fields.

    >>> import tempfile, numpy as np
    >>> root = tempfile.mkdtemp()
    >>> with CheckpointManager(root) as mgr:
    ...     mgr.save(1, {"w": np.arange(4.0), "lr": 0.1})
    True
    >>> CheckpointManager(root).restore()["w"]
    array([0., 1., 2., 3.])
    """

    def __init__(
        self, root: str | os.PathLike[str], options: CheckpointOptions | None = None, **kwargs: Any
    ) -> None:
        opts = options or CheckpointOptions()
        self.options = opts = replace(opts, **kwargs) if kwargs else opts
        self.ledger = RunLedger.starting(root, opts)  # the run ledger (see jaxckpt report)
        self._tiers: tuple[Tier, ...] = open_tiers(root, opts)  # every root valid before a write
        self._agreement = Agreement.for_root(
            self.root, primary=opts.primary_host, timeout_s=opts.save_timeout_s
        )
        self._watcher = PreemptionWatcher.for_policy(opts.save_policy)
        self._clock = StepClock(predict=jax.process_count() == 1)  # save(state.step) is free
        join_tiers(self._tiers, self._agreement, opts)  # epochs; the local tier's peers
        self._protocol, self._storage = self._tiers[0].protocol, self._tiers[0].storage
        self._promotion = open_promotion(self._tiers, self._agreement, opts, self.preempted)
        self._publisher = publisher = open_publisher(self._tiers, opts)  # publish=
        self._session = session = SaveSession(self._tiers[0], opts, self._agreement, self.root)
        self._retention = retention = Retention(
            self._tiers,
            primary=jax.process_index() == opts.primary_host,
            protected=(session.current_steps, publisher.pending),
            waiting=self._promotion,
            on_fenced=session.fence,
            bad=lambda: self._health.bad_steps(),
            deleted=lambda s: self._health.deleted(s),
        )
        fallback, guard = opts.fallback_on_corrupt, retention.restoring
        self._select = Selection(self._tiers, self._agreement, fallback, guard)
        session.corrupt = self._select.corrupt  # a save replaces a step found corrupt
        self._health = Health(self._tiers[-1].storage, self._select, self._agreement, opts)
        session.listen(self._promotion, self._health, publisher, retention)  # judged, then pruned
        self._promotion.start(on_promoted=retention.committed)
        self.ledger.opened(self)
        _openroots.register(self, () if self.epoch is None else tuple(t.uri for t in self._tiers))

    @property
    def root(self) -> str:
        """The root's URI (with a local tier: the durable root's)."""
        return self._tiers[-1].uri

    @property
    def local_root(self) -> str | None:
        """The local tier's URI, or None when saves go straight to ``root``."""
        return next((t.uri for t in self._tiers if t.own), None)

    @property
    def epoch(self) -> int | None:
        """This writer's epoch (None for a read-only manager)."""
        return self._protocol.epoch

    def compile(self, lowered: Any) -> Any:
        """``lowered.compile()``; with ``compilation_cache``, this process's kept executable."""
        return self.ledger.compile(lowered)

    @_collective("save")
    def save(
        self,
        step: int,
        state: Any,
        *,
        force: bool = False,
        metadata: dict[str, Any] | None = None,
        metrics: dict[str, float] | None = None,
        keep: bool = False,
        process_state: Any = None,
    ) -> bool:
        """Starts an asynchronous save of ``state`` as ``step``.

        Returns once the state is in host memory (its buffers may then be donated). When
        the policy says save, waits for the previous save first; else returns False.

        Args:
          step: the step number, unique under the root: a non-negative integer (an
            ``int``, a numpy integer or an integer scalar ``jax.Array`` such as ``state.step``).
          state: a pytree of arrays and int/float/bool/str/None values.
          force: save even when the save policy says not now.
          metadata: JSON-serialisable user metadata stored with the step.
          metrics: numbers the retention policy may rank steps by.
          keep: pin this step against deletion by retention.
          process_state: this process's state (bytes, str, JSON, or a callable: ``it.get_state``).

        Returns:
          True when a save was started, False when the save policy declined (or, within
          ``tolerate_failed_saves``, the store failed its checks: a full local disk).

        Raises:
          StepAlreadyExistsError: ``step`` is already committed.
          UnsupportedLeafError: a leaf cannot be saved (the path is named).
          SaveFailedError: the previous background save failed.
          WriterFencedError: another process opened the root for writing since.
        """
        self._session.check_writable()
        says = self._session.policy_says_save
        step, saving = self._clock.decide(step, force, says, self.preempted, self.latest_step)
        if not saving:
            self._session.check_background(tolerate=True)  # a failed save surfaces at once
            return False
        self._session.wait(tolerate=True)  # a step that cannot be promoted: told at the checks
        request, lost = self._promotion.request, self._promotion.lost_error()
        return self._session.save(
            step, state, metadata, metrics, keep, request, process_state, lost
        )

    @_collective("wait")
    def wait(self) -> None:
        """Blocks until the in-flight save is committed.

        Raises:
          SaveFailedError: the save failed, or a local step can no longer be promoted.
          SaveTimeoutError: it did not commit within ``save_timeout_s``.
          WriterFencedError: another process took over the root; nothing more commits.
        """
        self._session.wait()
        self._promotion.check_lost()

    def save_stats(self) -> list[SaveStats]:
        """Telemetry of the recent committed saves, oldest first (with a local tier, ``total_s``
        to the local commit, ``durable_s`` to the durable one: None while not durable)."""
        self._promotion.record_durable(self._session.recorder)
        return self._session.recorder.history()

    def wait_durable(self, step: int | None = None, timeout_s: float | None = None) -> int | None:
        """With a local tier: blocks until ``step`` (None: the newest asked, else durable) is
        committed on the durable root, within ``timeout_s`` (None: ``save_timeout_s``);
        returns the durable step waited for (None: nothing durable and nothing asked).

        Raises:
          PromotionError: it cannot be promoted (damaged local copy, fenced, nowhere).
          PromotionTimeoutError: not durable within ``timeout_s``.
          CheckpointError: the manager has no local tier.
        """
        self.wait()  # the local commit comes first
        timeout = self.options.save_timeout_s if timeout_s is None else timeout_s
        return self._promotion.wait_durable(step, timeout)

    @_collective("steps")
    def steps(self, tier: str | None = None) -> list[int]:
        """Committed steps, ascending (the primary's view; collective: call it on every
        process) of ``tier``, ``"local"`` or ``"durable"`` (None: every restorable step)."""
        return self._select.steps(tier)

    @_collective("latest")
    def latest_step(self) -> int | None:
        """The newest committed step of any tier, or None (newest markers only; collective)."""
        return self._select.latest()

    @_collective("restore")
    def restore(
        self,
        step: int | None = None,
        *,
        target: Any = None,
        partial: bool = False,
        rename: PathMap | None = None,
        allow_lossy_cast: bool | None = None,
    ) -> Any:
        """Restores a committed step (the newest good one by default); ``restored_step``
        then says which (older than ``latest_step()`` when the newest was corrupt or bad).
        Collective on several processes: all restore the primary's choice of step.

        Args:
          step: the step to restore (warns if it is marked bad); None: the newest step not
            marked bad, falling back past corrupt ones (``fallback_on_corrupt``; README).
          target: a pytree of arrays or ``jax.ShapeDtypeStruct`` (with shardings) giving
            the structure, dtypes and shardings of the result. Without it, arrays come
            back as read-only numpy arrays (views of the buffers read) in the saved nesting.
          partial: ``target`` may name a subset of the saved paths; only those are read
            (others are never opened). Without it, a target lacking saved paths is an error.
          rename: maps saved tree paths (as ``jax.tree_util.keystr`` writes them) to the
            target's: ``{saved prefix: new prefix}``, e.g. ``{"['params']['encoder']":
            "['params']['enc']"}``, or a function of a saved path (None: skip the leaf).
          allow_lossy_cast: ``target`` may convert to dtypes that lose values (float32 ->
            float16); None: ``options.allow_lossy_cast``. Lossless casts always happen.

        Raises:
          StepNotFoundError: no such committed step (the message lists them), or
            it was deleted while being restored.
          TreeMismatchError: ``target`` does not match the saved tree (every missing,
            extra and mismatched path is named), or converts lossily (path and dtypes).
          CorruptCheckpointError: a chunk fails its checksum (step, path and chunk named).
          ValueError: ``partial`` or ``rename`` without a ``target``.
        """
        if target is None and (partial or rename is not None):
            raise ValueError("restore(partial=..., rename=...) needs a target")
        self.wait()
        step = None if step is None else _check_step(step)
        lossy = self.options.allow_lossy_cast if allow_lossy_cast is None else allow_lossy_cast
        plan = self._health.plan(step)  # the steps to skip, after a crash-loop check
        restored = self._select.restore(step, target, partial, rename, lossy, **plan.hooks)
        return self._restored(self._health.restored(plan, restored))

    def metadata(self, step: int) -> StepMetadata:
        """The user metadata and a description of the saved tree of ``step``."""
        step = _check_step(step)
        return step_metadata(self._select.holder(step).protocol, step)

    def verify(
        self, step: int, *, on_progress: Callable[[int], None] | None = None
    ) -> VerifyReport:
        """Re-reads every chunk of ``step`` and checks it against the manifest."""
        step = _check_step(step)
        tier = self._select.holder(step)
        return verify_step(tier.protocol, tier.context, step, on_progress=on_progress)

    def explain(self) -> dict[int, tuple[str, ...]]:
        """For every committed step, the rules that keep it (empty: would be deleted)."""
        return self._retention.explain(self._tiers[0])

    def wait_for_deletions(self, timeout_s: float | None = None) -> None:
        """Blocks until background retention deletions have finished."""
        self._retention.wait(timeout_s)

    def delete(self, step: int) -> None:
        """Deletes a committed step (marker first, then data); with a local tier, from both.

        Raises:
          StepNotFoundError: no such step.
          CheckpointError: the step is being saved.
          WriterFencedError: another process took over the root.
        """
        self._session.check_deletable(step := _check_step(step))
        self._promotion.withdraw(step)  # never promote a deleted step
        self._retention.delete(step)

    def garbage_collect(
        self, *, older_than_s: float | None = None, force: bool = False
    ) -> list[int]:
        """Removes partial, orphaned and fenced attempts; returns their steps.

        Args:
          older_than_s: keep younger attempts of this epoch (default ``gc_grace_s``).
          force: also remove damaged commit markers and their steps' data.
        """
        self._session.check_writable()
        self.wait()  # this manager's own in-flight save commits first
        grace = self.options.gc_grace_s if older_than_s is None else older_than_s
        return self._tiers[0].garbage_collect(grace, force=force)

    @_collective("close")
    def close(self) -> None:
        """Waits for the in-flight save (after an interrupted ``wait()`` too), then frees all.

        Raises:
          SaveFailedError: the in-flight save failed and did not commit.
          SaveTimeoutError: it did not commit within ``save_timeout_s``.
          WriterFencedError: another process took over the root.
        """
        if self._session.closed:
            return
        ok = False  # what a run can do without: waited for close_wait_s in all, at the end
        try:
            self.wait()  # after an interrupted wait() too: commits or raises
            self._select.catch_up(closing=True)  # a run that never used the durable root
            ok = True
        finally:
            _openroots.unregister(self)
            self._session.close()
            self._promotion.close(self.options.save_timeout_s)  # "external" is not waited for
            by = self.ledger.closing_by = time.monotonic() + self.ledger.close_wait_s()
            if ok and not self._health.ended("clean" if self._clean_exit else None, _left(by)):
                by = self.ledger.unanswered()  # the exit record (of a clean exit) was retried
            for part in (self._publisher, self._watcher):  # (no watcher without OnPreemption)
                if part is not None:
                    part.close()
            self._retention.close(_left(by))
            self._agreement.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._clean_exit = exc_type is None or not issubclass(exc_type, Exception)  # ^C: clean
        try:
            self.close()
        except CheckpointError as e:
            if exc_type is None:
                raise
            log.error("while closing after an error: %s", e)
