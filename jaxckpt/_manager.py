"""CheckpointManager: the public entry point; it builds the parts and delegates to them.

The manager holds its tiers (:mod:`jaxckpt._tier`, nearest first), the save
session (:mod:`jaxckpt._save`), retention (:mod:`jaxckpt._retention`),
promotion (:mod:`jaxckpt._promotion`), the agreement among hosts and the
preemption watcher. A save goes manager → :class:`~jaxckpt._save.SaveSession`
→ Orbax AsyncCheckpointer → :class:`~jaxckpt._handler.ZarrHandler` →
``SaveSession.write`` → :class:`~jaxckpt._tsio.ArrayWriter` → TensorStore; a
restore goes manager → :func:`jaxckpt._select.restore` →
:class:`~jaxckpt._restore.StepReader`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import jax

from jaxckpt import _select
from jaxckpt._agree import Agreement
from jaxckpt._keys import check_step as _check_step
from jaxckpt._metadata import StepMetadata, step_metadata
from jaxckpt._options import CheckpointOptions
from jaxckpt._peertier import join_tiers
from jaxckpt._preemption import PreemptionWatcher
from jaxckpt._procstate import ProcessStateAccess
from jaxckpt._promotion import open_promotion
from jaxckpt._retention import Retention
from jaxckpt._save import SaveSession
from jaxckpt._telemetry import SaveStats
from jaxckpt._tier import Tier, open_tiers
from jaxckpt._tree import PathMap
from jaxckpt._verify import VerifyReport, verify_step
from jaxckpt.errors import CheckpointError

log = logging.getLogger("jaxckpt")


class CheckpointManager(ProcessStateAccess):
    """Saves and restores checkpoints of a JAX pytree under one root.

    Saves are asynchronous: ``save`` returns once the state is in host memory;
    the data is written in the background and becomes visible only when its
    commit marker is written. At most one save is in flight.

    With ``local_root`` there are two tiers: saves commit to the fast local root, and steps
    ``promote_policy`` chooses are promoted to ``root`` (durable) in the background or by a
    ``jaxckpt promote`` sidecar; ``restore`` reads the newest step of either (see README).

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
        self._tiers: tuple[Tier, ...] = open_tiers(root, opts)  # every root valid before a write
        self._agreement = Agreement.for_root(
            self.root, primary=opts.primary_host, timeout_s=opts.save_timeout_s
        )
        self._watcher = PreemptionWatcher.for_policy(opts.save_policy)
        join_tiers(self._tiers, self._agreement, opts)  # epochs; the local tier's peers
        self._protocol, self._storage = self._tiers[0].protocol, self._tiers[0].storage
        self._promotion = open_promotion(self._tiers, self._agreement, opts, self.preempted)
        self._session = session = SaveSession(self._tiers[0], opts, self._agreement, self.root)
        self._retention = retention = Retention(
            self._tiers,
            primary=jax.process_index() == opts.primary_host,
            protected=(session.current_steps, self._promotion.pending_steps),
            on_fenced=session.fence,
        )
        session.listen(self._promotion, retention)
        self._promotion.start(on_promoted=retention.committed)
        fallback, guard = opts.fallback_on_corrupt, retention.restoring
        self._select = _select.Selection(self._tiers, self._agreement, fallback, guard)

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

        Returns once the state is copied to host memory; the caller may then
        donate or overwrite its buffers. When the policy says save, waits for the
        previous save first; when it declines, returns False at once.

        Args:
          step: the step number (a non-negative int, unique under the root).
          state: a pytree of arrays and int/float/bool/str/None values.
          force: save even when the save policy says not now.
          metadata: JSON-serialisable user metadata stored with the step.
          metrics: numbers the retention policy may rank steps by.
          keep: pin this step against deletion by retention.
          process_state: this process's own state (bytes, str, JSON), e.g. a data iterator's.

        Returns:
          True when a save was started, False when the save policy declined.

        Raises:
          StepAlreadyExistsError: ``step`` is already committed.
          UnsupportedLeafError: a leaf cannot be saved (the path is named).
          SaveFailedError: the previous background save failed.
          WriterFencedError: another process opened the root for writing since.
        """
        self._session.check_writable()
        says = self._session.policy_says_save
        if not force and not says(_check_step(step), self.preempted, self.latest_step):
            self._session.check_background()  # a finished failed save still surfaces, at once
            return False
        self.wait()
        request = self._promotion.request
        self._session.save(step, state, metadata, metrics, keep, request, process_state)
        return True

    def preempted(self, step: int = 0) -> bool:
        """True once SIGTERM/SIGINT or JAX's preemption notice came (``policy.OnPreemption``)."""
        return self._watcher is not None and self._watcher.preempted(step)

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
        """Telemetry of the recent committed saves, oldest first.

        With a local tier, ``total_s`` is the time to the local commit and ``durable_s`` to
        the durable commit (None while not durable, or not chosen by the promote policy).
        """
        self._promotion.record_durable(self._session.recorder)
        return self._session.recorder.history()

    def wait_durable(self, step: int | None = None, timeout_s: float | None = None) -> int | None:
        """With a local tier: blocks until ``step`` is committed on the durable root; returns
        the durable step waited for (None: nothing durable and nothing asked).

        Args:
          step: a step chosen for promotion; None: the newest step this manager asked to
            promote (when it asked for none, the newest durable step is returned).
          timeout_s: how long to wait; None means ``save_timeout_s``.

        Raises:
          PromotionError: the step cannot be promoted (a damaged local copy, a
            fenced job, or it is neither local nor durable).
          PromotionTimeoutError: not durable within ``timeout_s``.
          CheckpointError: the manager has no local tier.
        """
        self.wait()  # the local commit comes first
        timeout = self.options.save_timeout_s if timeout_s is None else timeout_s
        return self._promotion.wait_durable(step, timeout)

    def steps(self, tier: str | None = None) -> list[int]:
        """Committed steps, ascending (the primary's view, on every process).

        On several processes this is collective: call it on every process.

        Args:
          tier: with a local tier, ``"local"`` or ``"durable"`` lists one tier;
            None lists every restorable step of either.
        """
        return self._select.steps(tier)

    def latest_step(self) -> int | None:
        """The newest committed step of any tier, or None (reads the newest markers only).

        On several processes this is collective: call it on every process.
        """
        return self._select.latest()

    def restore(
        self,
        step: int | None = None,
        *,
        target: Any = None,
        partial: bool = False,
        rename: PathMap | None = None,
        allow_lossy_cast: bool | None = None,
    ) -> Any:
        """Restores a committed step (the newest by default); ``restored_step`` then says
        which (older than ``latest_step()`` when the newest was corrupt).

        On several processes this is collective: every process restores the
        same step and attempt, the primary's choice.

        Args:
          step: the step to restore; None means the newest committed step, falling
            back to older steps if it is corrupt (``fallback_on_corrupt``).
          target: a pytree of arrays or ``jax.ShapeDtypeStruct`` (with shardings)
            giving the structure, dtypes and shardings of the result. Without it,
            arrays come back as numpy arrays in the saved nesting. Numpy results
            are read-only (usually views of the buffers read, to avoid a copy);
            ``np.array(x)`` gives a writable copy.
          partial: ``target`` may name a subset of the saved paths; only those are
            read (saved leaves outside it are never opened, so they may even be
            damaged). Without it, a target that lacks saved paths is an error.
          rename: maps saved tree paths to the target's (model surgery): a mapping
            ``{saved prefix: new prefix}`` of paths as ``jax.tree_util.keystr`` (and
            ``jaxckpt inspect``) writes them, e.g. ``{"['params']['encoder']":
            "['params']['enc']"}``, or a function from a saved path to its new path
            or ``None`` to skip the leaf.
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
        return self._restored(self._select.restore(step, target, partial, rename, lossy))

    def metadata(self, step: int) -> StepMetadata:
        """The user metadata and a description of the saved tree of ``step``."""
        return step_metadata(self._select.holder(_check_step(step)).protocol, step)

    def verify(
        self, step: int, *, on_progress: Callable[[int], None] | None = None
    ) -> VerifyReport:
        """Re-reads every chunk of ``step`` and checks it against the manifest."""
        tier = self._select.holder(_check_step(step))
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
        self._session.check_writable()
        if _check_step(step) in self._session.current_steps():
            raise CheckpointError(f"step {step} is being saved; wait() before deleting it")
        self._promotion.withdraw(step)  # never promote a deleted step
        self._retention.delete(step)

    def garbage_collect(
        self, *, older_than_s: float | None = None, force: bool = False
    ) -> list[int]:
        """Removes partial, orphaned and fenced attempts; returns their steps.

        Args:
          older_than_s: attempts of the current epoch younger than this are kept
            (default ``gc_grace_s``); this manager's own in-flight save always is.
          force: also remove damaged commit markers and their steps' data.
        """
        self._session.check_writable()
        self.wait()  # this manager's own in-flight save commits first
        grace = self.options.gc_grace_s if older_than_s is None else older_than_s
        return self._tiers[0].garbage_collect(grace, force=force)

    def close(self) -> None:
        """Waits for the in-flight save and releases resources. Idempotent.

        After a ``KeyboardInterrupt`` in ``wait()`` it still waits for the
        in-flight save: it returns once the step committed, or raises.

        Raises:
          SaveFailedError: the in-flight save failed and did not commit.
          SaveTimeoutError: it did not commit within ``save_timeout_s``.
          WriterFencedError: another process took over the root.
        """
        if self._session.closed:
            return
        try:
            self.wait()  # after an interrupted wait() too: commits or raises
        finally:
            self._session.close()
            self._promotion.close(self.options.save_timeout_s)  # "external" is not waited for
            self._retention.close()
            if self._watcher is not None:
                self._watcher.close()
            self._agreement.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self.close()
        except CheckpointError as e:
            if exc_type is None:
                raise
            log.error("while closing after an error: %s", e)
