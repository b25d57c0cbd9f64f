"""CheckpointManager: the public entry point that ties the pieces together.

A save goes manager → Orbax AsyncCheckpointer → :class:`~jaxckpt._handler.ZarrHandler`
→ :class:`~jaxckpt._tsio.ArrayWriter` → TensorStore; the commit goes through
:class:`~jaxckpt._commit.CommitProtocol`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, NoReturn

import jax
import tensorstore as ts

from jaxckpt import _handler, policy
from jaxckpt._agree import Agreement
from jaxckpt._commit import CommitProtocol, retention_decision
from jaxckpt._options import CheckpointOptions
from jaxckpt._phases import reached
from jaxckpt._preemption import PreemptionWatcher
from jaxckpt._records import ManifestPart, json_record
from jaxckpt._restore import StepReader, load_step
from jaxckpt._storage import open_storage
from jaxckpt._telemetry import SaveRecorder, SaveStats
from jaxckpt._tree import PathMap, SavedLeaf, describe_state
from jaxckpt._tsio import ArrayWriter, HostArray
from jaxckpt._verify import VerifyReport, verify_step
from jaxckpt._versions import writer_versions
from jaxckpt.errors import (
    CheckpointError,
    CorruptCheckpointError,
    SaveFailedError,
    SaveTimeoutError,
    StepAlreadyExistsError,
    StepNotFoundError,
)

log = logging.getLogger("jaxckpt")


@dataclass(frozen=True, kw_only=True)
class LeafInfo:
    """One leaf of a saved tree, as :meth:`CheckpointManager.metadata` reports it."""

    path: str
    kind: str
    shape: tuple[int, ...] | None
    dtype: str | None
    sharding: dict[str, Any] | None
    nbytes: int
    value: Any = None


@dataclass(frozen=True, kw_only=True)
class StepMetadata:
    """A committed step: when, how big, the user's metadata and the tree."""

    step: int
    commit_time: float
    nbytes: int
    metrics: dict[str, float]
    keep: bool
    user_metadata: Any
    tree: tuple[LeafInfo, ...]
    versions: Mapping[str, str] = field(default_factory=dict)
    """Versions of jaxckpt, jax, orbax-checkpoint, tensorstore, numpy that wrote the step
    (empty for steps written before they were recorded)."""


@dataclass
class _Inflight:
    step: int
    tree: bytes
    metrics: dict[str, float] | None
    keep: bool
    nbytes: int = 0


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return step


class CheckpointManager:
    """Saves and restores checkpoints of a JAX pytree under one root.

    Saves are asynchronous: ``save`` returns once the state is in host memory;
    the data is written in the background and becomes visible only when its
    commit marker is written. At most one save is in flight.

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
        self.options = replace(opts, **kwargs) if kwargs else opts
        self._storage = open_storage(root, **dict(self.options.storage_options))
        self._protocol = CommitProtocol(self._storage)
        self._context = ts.Context(self._storage.context_spec())
        self._arrays = ArrayWriter(
            self._storage, self._context, max_inflight_bytes=self.options.max_inflight_bytes
        )
        self._reader = StepReader(self._protocol, self._arrays, self._context)
        self._recorder = SaveRecorder()
        self._lock = threading.Lock()
        self._inflight: _Inflight | None = None
        self._checkpointer: Any = None
        self._closed = False
        self._primary = jax.process_index() == self.options.primary_host
        self._agreement = Agreement(
            f"{zlib.crc32(self.root.encode()):08x}",
            primary=self.options.primary_host,
            timeout_s=self.options.save_timeout_s,
        )
        self._last_saved: tuple[int | None, float | None] | None = None
        self._restoring: set[int] = set()
        self._deleter = ThreadPoolExecutor(1, thread_name_prefix="jaxckpt-retention")
        self._deletion: Future[None] | None = None
        self._watcher = PreemptionWatcher() if _wants_preemption(self.options.save_policy) else None
        if self.options.read_only:
            self._protocol.ensure_root(create=False)
        elif self._primary:  # other hosts write only after the primary began a step
            self._protocol.ensure_root(create=True)
            if self.options.gc_on_open:
                self._protocol.collect_garbage()

    @property
    def root(self) -> str:
        """The root's URI."""
        return self._storage.uri

    # -- saving --------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Any,
        *,
        force: bool = False,
        metadata: dict[str, Any] | None = None,
        metrics: dict[str, float] | None = None,
        keep: bool = False,
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

        Returns:
          True when a save was started, False when the save policy declined.

        Raises:
          StepAlreadyExistsError: ``step`` is already committed.
          UnsupportedLeafError: a leaf cannot be saved (the path is named).
          SaveFailedError: the previous background save failed.
        """
        self._check_writable()
        _check_step(step)
        if not force and not self._policy_says_save(step):
            self._check_background()  # a finished failed save still surfaces, without waiting
            return False
        self.wait()
        if self._protocol.read_marker(step) is not None:
            raise StepAlreadyExistsError(f"step {step} already exists under {self.root}")
        leaves, values = describe_state(state, chunk_bytes=self.options.chunk_bytes)
        tree = self._tree_record(step, leaves, metadata)
        checkpointer = self._ensure_checkpointer()
        with self._lock:
            self._inflight = _Inflight(step=step, tree=tree, metrics=metrics, keep=keep)
        self._recorder.started(step)
        try:
            checkpointer.save(
                _handler.orbax_step_path(step),
                args=_handler.SaveArgs(step=step, leaves=leaves, values=values),
            )
        except Exception as e:
            self._recorder.failed(step)
            with self._lock:
                self._inflight = None
            if isinstance(e, CheckpointError):
                raise
            raise SaveFailedError(f"save of step {step} under {self.root} failed: {e}") from e
        self._recorder.blocked(step)
        self._last_saved = (step, time.monotonic())
        return True

    def _policy_says_save(self, step: int) -> bool:
        save_policy = self.options.save_policy
        if save_policy is None:
            return True
        if self._last_saved is None:
            self._last_saved = (self.latest_step(), None)
        last_step, last_time = self._last_saved
        ctx = policy.SaveContext(
            step=step,
            now=time.monotonic(),
            last_saved_step=last_step,
            last_save_time=last_time,
            preempted=self.preempted(step),
            blocking_seconds=tuple(s.blocking_s for s in self._recorder.history()[-8:]),
        )
        return bool(self._agreement.agree("save", save_policy.should_save(ctx)))

    def preempted(self, step: int = 0) -> bool:
        """True once SIGTERM/SIGINT (or JAX's preemption notice) has arrived.

        Only watched when the save policy includes ``policy.OnPreemption()``.
        """
        return self._watcher is not None and self._watcher.preempted(step)

    def _tree_record(self, step: int, leaves: Sequence[SavedLeaf], metadata: Any) -> bytes:
        try:
            return json_record(
                step=step,
                leaves=[x.to_json() for x in leaves],
                metadata=metadata,
                versions=dict(writer_versions()),
            )
        except (TypeError, ValueError) as e:
            raise CheckpointError(
                f"step {step}: metadata and non-array leaves must be JSON-serialisable: {e}"
            ) from e

    def _ensure_checkpointer(self) -> Any:
        if self._checkpointer is None:
            self._checkpointer = _handler.make_checkpointer(
                _Writer(self),
                timeout_s=self.options.save_timeout_s,
                primary_host=self.options.primary_host,
            )
        return self._checkpointer

    def wait(self) -> None:
        """Blocks until the in-flight save is committed.

        Raises:
          SaveFailedError: the background save failed (the step is not committed).
          SaveTimeoutError: it did not commit within ``save_timeout_s``.
        """
        if self._checkpointer is None:
            return
        try:
            self._checkpointer.wait_until_finished()
        except Exception as e:
            self._raise_failed(e)

    def _check_background(self) -> None:
        if self._checkpointer is None:
            return
        try:
            self._checkpointer.check_for_errors()
        except Exception as e:
            self._raise_failed(e)

    def _raise_failed(self, e: Exception) -> NoReturn:
        with self._lock:
            step = self._inflight.step if self._inflight else None
            self._inflight = None
        if step is not None:
            self._recorder.failed(step)
        if isinstance(e, TimeoutError):
            raise SaveTimeoutError(
                f"save of step {step} under {self.root} did not commit within "
                f"{self.options.save_timeout_s:.0f}s: {e}"
            ) from e
        raise SaveFailedError(
            f"background save of step {step} under {self.root} failed: {e}"
        ) from e

    def save_stats(self) -> list[SaveStats]:
        """Telemetry of the recent committed saves, oldest first."""
        return self._recorder.history()

    # -- reading -------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return sorted(self._protocol.committed())

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def restore(
        self,
        step: int | None = None,
        *,
        target: Any = None,
        partial: bool = False,
        rename: PathMap | None = None,
    ) -> Any:
        """Restores a committed step (the newest by default).

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

        Raises:
          StepNotFoundError: no such committed step (the message lists them).
          TreeMismatchError: ``target`` does not match the saved tree (every missing,
            extra and mismatched path is named).
          CorruptCheckpointError: a chunk fails its checksum (step, path and chunk named).
          ValueError: ``partial`` or ``rename`` without a ``target``.
        """
        if target is None and (partial or rename is not None):
            raise ValueError("restore(partial=..., rename=...) needs a target")
        self.wait()
        how = {"partial": partial, "rename": rename}
        if step is not None:
            return self._restore_step(_check_step(step), target, **how)
        candidates = self._agreement.agree("restore", sorted(self._protocol.committed())[::-1])
        if not candidates:
            raise StepNotFoundError(f"no committed steps under {self.root}")
        for i, s in enumerate(candidates):
            # Each process reads only its own regions, so one may find a corrupt
            # chunk that the others never read: all fall back together, or none.
            try:
                restored, error = self._restore_step(s, target, **how), None
            except CorruptCheckpointError as e:
                restored, error = None, e
            if not self._agreement.any_true("restore-corrupt", error is not None):
                return restored
            if error is None:
                error = CorruptCheckpointError(
                    f"step {s} under {self.root} is corrupt in a region another process read"
                )
            if not self.options.fallback_on_corrupt or i == len(candidates) - 1:
                raise error
            log.warning(
                "step %d is corrupt (%s); falling back to step %d", s, error, candidates[i + 1]
            )
        raise AssertionError("unreachable")

    def _restore_step(self, step: int, target: Any, **how: Any) -> Any:
        with self._lock:
            self._restoring.add(step)
        try:
            marker = self._protocol.require_marker(step)
            return self._reader.restore(load_step(self._protocol, marker), target, **how)
        finally:
            with self._lock:
                self._restoring.discard(step)

    def metadata(self, step: int) -> StepMetadata:
        """The user metadata and a description of the saved tree of ``step``."""
        marker = self._protocol.require_marker(_check_step(step))
        loaded = load_step(self._protocol, marker)
        tree = tuple(
            LeafInfo(
                path=leaf.path_text,
                kind=leaf.kind,
                shape=leaf.shape if leaf.kind != "value" else None,
                dtype=leaf.dtype,
                sharding=leaf.sharding,
                nbytes=leaf.nbytes,
                value=leaf.value,
            )
            for leaf in loaded.leaves
        )
        return StepMetadata(
            step=step,
            commit_time=marker.time,
            nbytes=marker.nbytes,
            metrics=dict(marker.metrics),
            keep=marker.keep,
            user_metadata=loaded.user_metadata,
            tree=tree,
            versions=dict(loaded.versions),
        )

    def verify(
        self, step: int, *, on_progress: Callable[[int], None] | None = None
    ) -> VerifyReport:
        """Re-reads every chunk of ``step`` and checks it against the manifest."""
        return verify_step(
            self._protocol, self._context, _check_step(step), on_progress=on_progress
        )

    # -- retention -----------------------------------------------------------

    def explain(self) -> dict[int, tuple[str, ...]]:
        """For every committed step, the rules that keep it (empty: would be deleted)."""
        decision = self._retention_decision()
        return {s: decision.keep.get(s, ()) for s in sorted(self._protocol.committed())}

    def _retention_decision(self) -> policy.RetentionDecision:
        with self._lock:
            protected = set(self._restoring)
            if self._inflight is not None:
                protected.add(self._inflight.step)
        return retention_decision(
            self._protocol.committed(), self.options.retention, protected=protected
        )

    def _apply_retention(self) -> None:
        try:
            for step in self._retention_decision().delete:
                log.info("retention: deleting step %d under %s", step, self.root)
                self._protocol.delete(step)
        except Exception:
            log.exception(
                "retention under %s failed; it will be retried after the next save", self.root
            )

    def _schedule_retention(self) -> None:
        if self.options.retention is None or not self._primary:
            return
        self._deletion = self._deleter.submit(self._apply_retention)

    def wait_for_deletions(self, timeout_s: float | None = None) -> None:
        """Blocks until background retention deletions have finished."""
        if self._deletion is not None:
            self._deletion.result(timeout=timeout_s)

    # -- deleting ------------------------------------------------------------

    def delete(self, step: int) -> None:
        """Deletes a committed step (marker first, then data).

        Raises:
          StepNotFoundError: no such step.
          CheckpointError: the step is being saved.
        """
        self._check_writable()
        self._protocol.require_marker(_check_step(step))
        with self._lock:
            if self._inflight is not None and self._inflight.step == step:
                raise CheckpointError(f"step {step} is being saved; wait() before deleting it")
        self._protocol.delete(step)

    def garbage_collect(self, *, older_than_s: float = 0.0) -> list[int]:
        """Removes partial (uncommitted) steps; returns their numbers."""
        self._check_writable()
        with self._lock:
            busy = self._inflight.step if self._inflight else None
        if busy is not None:
            self.wait()
        return self._protocol.collect_garbage(older_than_s=older_than_s)

    # -- lifecycle -----------------------------------------------------------

    def close(self) -> None:
        """Waits for the in-flight save and releases resources. Idempotent."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            if self._checkpointer is not None:
                self._checkpointer.close()
            self._deleter.shutdown(wait=True)
            if self._watcher is not None:
                self._watcher.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except CheckpointError as e:
            log.error("while closing after an error: %s", e)

    def _check_writable(self) -> None:
        if self._closed:
            raise CheckpointError(f"the manager of {self.root} is closed")
        if self.options.read_only:
            raise CheckpointError(f"the manager of {self.root} is read-only")


def _wants_preemption(save_policy: Any) -> bool:
    parts = save_policy.policies if isinstance(save_policy, policy.AnySave) else (save_policy,)
    return any(isinstance(p, policy.OnPreemption) for p in parts)


class _Writer:
    """The manager's side of a save, called by the Orbax handler and commit path."""

    def __init__(self, manager: CheckpointManager) -> None:
        self._m = manager

    def begin(self, step: int) -> None:
        self._m._protocol.begin_save(step)

    def write(self, step: int, leaves: Sequence[SavedLeaf], arrays: Sequence[HostArray]) -> None:
        m = self._m
        inflight = m._inflight
        assert inflight is not None and inflight.step == step
        if m._primary:
            m._arrays.write_group(step)
            m._protocol.write_tree(step, inflight.tree)
        records = m._arrays.write(step, arrays)
        part = ManifestPart(
            step=step,
            process=jax.process_index(),
            num_processes=jax.process_count(),
            arrays=records,
        )
        m._protocol.write_manifest_part(part)
        reached("manifest_written", step)
        inflight.nbytes = part.nbytes

    def commit(self, step: int) -> None:
        m = self._m
        inflight = m._inflight
        assert inflight is not None and inflight.step == step
        m._protocol.commit(
            step,
            num_processes=jax.process_count(),
            metrics=inflight.metrics,
            keep=inflight.keep,
        )
        m._recorder.committed(step, inflight.nbytes)
        with m._lock:
            m._inflight = None
        m._schedule_retention()
