"""CheckpointManager: the public entry point that ties the pieces together.

A save goes manager → Orbax AsyncCheckpointer → :class:`~jaxckpt._handler.ZarrHandler`
→ :class:`~jaxckpt._save.SaveSession` → :class:`~jaxckpt._tsio.ArrayWriter` → TensorStore;
the commit goes through :class:`~jaxckpt._commit.CommitProtocol`.
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

from jaxckpt import _gc, _handler, errors, policy
from jaxckpt._agree import Agreement
from jaxckpt._commit import CommitProtocol, retention_decision
from jaxckpt._layout import StepLocation, new_attempt
from jaxckpt._layout import check_step as _check_step
from jaxckpt._options import CheckpointOptions
from jaxckpt._pack import PackWriter
from jaxckpt._preemption import PreemptionWatcher
from jaxckpt._promote import PromotionRequest
from jaxckpt._records import CommitMarker, json_record
from jaxckpt._restore import StepReader, load_step
from jaxckpt._save import Inflight, SaveSession
from jaxckpt._storage import open_storage
from jaxckpt._telemetry import SaveRecorder, SaveStats
from jaxckpt._tiers import DurableTier, TieredRestore, local_everywhere, require_own_local_roots
from jaxckpt._tree import PathMap, SavedLeaf, describe_state
from jaxckpt._tsio import ArrayWriter
from jaxckpt._verify import VerifyReport, verify_step
from jaxckpt._versions import writer_versions
from jaxckpt.errors import (
    CheckpointError,
    CorruptCheckpointError,
    SaveFailedError,
    SaveTimeoutError,
    StepAlreadyExistsError,
    StepNotFoundError,
    WriterFencedError,
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


class CheckpointManager:
    """Saves and restores checkpoints of a JAX pytree under one root.

    Saves are asynchronous: ``save`` returns once the state is in host memory;
    the data is written in the background and becomes visible only when its
    commit marker is written. At most one save is in flight.

    With ``local_root`` the manager has two tiers: saves commit to the fast
    local root, and the steps ``promote_policy`` chooses are promoted to
    ``root`` (the durable tier) in the background or by a ``jaxckpt promote``
    sidecar; ``restore`` reads the newest step of either tier (see the README).

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
        self._durable: DurableTier | None = None
        local_root = self.options.local_root
        save_root = root if local_root is None else local_root
        self._storage = open_storage(save_root, **self.options.storage_kwargs(os.fspath(save_root)))
        self._protocol = CommitProtocol(self._storage)
        self._context = ts.Context(self._storage.context_spec())
        self._arrays = ArrayWriter(
            self._storage, self._context, max_inflight_bytes=self.options.max_inflight_bytes
        )
        self._reader = StepReader(self._protocol, self._arrays, self._context)
        self._recorder = SaveRecorder()
        self._lock = threading.Lock()
        self._primary = jax.process_index() == self.options.primary_host
        self._session = SaveSession(
            self._protocol,
            self._arrays,
            self._recorder,
            primary=self._primary,
            on_commit=self._committed,
            packer=PackWriter(self._storage) if self.options.layout == "packed" else None,
            per_host=local_root is not None,
        )
        self._checkpointer: Any = None
        self._closed = False
        self._fenced: WriterFencedError | None = None
        self._agreement = Agreement(
            _namespace(self.root if local_root is None else os.fspath(root)),  # same on every host
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
            self._open_durable(root)
            return
        if local_root is not None:  # each host writes its own local root, in its own epoch
            require_own_local_roots(self._agreement, self._storage.uri)
            self._protocol.ensure_root(create=True)
            self._protocol.take_epoch()
            if self.options.gc_on_open:
                self._collect_on_open()
            self._open_durable(root)
            return
        epoch = None
        if self._primary:  # other hosts write only after the primary began a step
            self._protocol.ensure_root(create=True)
            epoch = self._protocol.take_epoch().epoch
            if self.options.gc_on_open:
                self._collect_on_open()
        self._protocol.epoch = self._agreement.agree("epoch", epoch)  # one epoch per job
        self._open_durable(root)

    def _open_durable(self, root: str | os.PathLike[str]) -> None:
        """With a local tier: the durable root, its epoch, and the promoter."""
        opts = self.options
        if opts.local_root is None:
            return
        self._durable = DurableTier(
            os.fspath(root),
            self._protocol,
            storage_options=opts.storage_kwargs(os.fspath(root)),
            max_inflight_bytes=opts.max_inflight_bytes,
            read_only=opts.read_only,
            promotion=opts.promotion,
            promote_policy=opts.promote_policy,
            retention=opts.retention,
            gc_grace_s=opts.gc_grace_s if opts.gc_on_open else None,
            agreement=self._agreement,
            primary_host=opts.primary_host,
            parts_timeout_s=opts.save_timeout_s,
        )

    def _collect_on_open(self) -> None:
        """Removes fenced and stale attempts; a failure leaves them for the next writer."""
        try:
            found = _gc.scan(self._protocol, full=False)
            _gc.collect(self._protocol, found, grace_s=self.options.gc_grace_s)
        except CheckpointError as e:
            log.warning("garbage collection on open of %s failed (retried later): %s", self.root, e)

    @property
    def root(self) -> str:
        """The root's URI (with a local tier: the durable root's)."""
        return self._storage.uri if self._durable is None else self._durable.uri

    @property
    def local_root(self) -> str | None:
        """The local tier's URI, or None when saves go straight to ``root``."""
        return None if self._durable is None else self._storage.uri

    @property
    def epoch(self) -> int | None:
        """This writer's epoch (None for a read-only manager)."""
        return self._protocol.epoch

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
          WriterFencedError: another process opened the root for writing since.
        """
        self._check_writable()
        _check_step(step)
        if not force and not self._policy_says_save(step):
            self._check_background()  # a finished failed save still surfaces, without waiting
            return False
        self.wait()
        listing = self._protocol.listing()  # begin_save's checks reuse it
        if self._protocol.read_marker(step, listing) is not None:
            raise StepAlreadyExistsError(f"step {step} already exists under {self.root}")
        leaves, values = describe_state(state, chunk_bytes=self.options.chunk_bytes)
        tree = self._tree_record(step, leaves, metadata)
        checkpointer = self._ensure_checkpointer()
        request = None
        if self._durable is None:
            attempt = self._agreement.agree("attempt", new_attempt(self._protocol.write_epoch()))
        else:  # every host's local root has its own epoch, hence attempt
            attempt = new_attempt(self._protocol.write_epoch())
            if jax.process_count() > 1:  # every local copy holds the primary's tree record
                tree = self._agreement.agree("tree", tree.decode()).encode()
            request = self._promotion_request(step)
        self._session.start(
            Inflight(
                loc=StepLocation(step, attempt),
                tree=tree,
                metrics=metrics,
                keep=keep,
                request=request,
                listing=listing,
            )
        )
        try:
            checkpointer.save(
                _handler.orbax_step_path(step),
                args=_handler.SaveArgs(step=step, leaves=leaves, values=values),
            )
        except Exception as e:
            self._session.end(failed=True)
            fenced = _fence_error(e) or self._fenced_now(step)
            if fenced is not None:
                self._fenced = fenced
                raise fenced from e
            if isinstance(e, CheckpointError):
                raise
            raise SaveFailedError(f"save of step {step} under {self.root} failed: {e}") from e
        self._recorder.blocked(step)
        self._last_saved = (step, time.monotonic())
        return True

    def _promotion_request(self, step: int) -> PromotionRequest | None:
        """Whether ``step`` is to be promoted (the primary's answer), and its request.

        The request is written with the save, before the local marker, so a
        trainer killed right after its local commit loses nothing.
        """
        durable = self._durable
        assert durable is not None
        chosen = durable.chosen(step, preempted=self.preempted(step))
        if not self._agreement.agree("promote", chosen):
            return None
        attempt = None
        if jax.process_count() > 1:  # every host uploads its part into this durable attempt
            attempt = self._agreement.agree("durable-attempt", durable.new_attempt())
        return durable.new_request(step, saved=time.time(), attempt=attempt)

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
                self._session,
                timeout_s=self.options.save_timeout_s,
                primary_host=self.options.primary_host,
                per_host=self._durable is not None,
                writer_nice=self.options.writer_nice,
            )
        return self._checkpointer

    def wait(self) -> None:
        """Blocks until the in-flight save is committed.

        Raises:
          SaveFailedError: the background save failed (the step is not committed).
          SaveTimeoutError: it did not commit within ``save_timeout_s``.
          WriterFencedError: another process took over the root; nothing more commits.
        """
        if self._fenced is not None:
            raise self._fenced
        if self._checkpointer is None:
            return
        try:
            self._checkpointer.wait_until_finished()
        except Exception as e:
            self._raise_failed(e)
        if not self._primary and self._session.current() is not None:
            self._session.end(failed=False)  # Orbax's final barrier: the primary committed
        self._await_commit()

    def _await_commit(self) -> None:
        """Waits until the in-flight save committed or failed.

        Orbax joins its background thread, but a ``KeyboardInterrupt`` during
        ``Thread.join`` can leave the thread looking finished to later joins
        (CPython < 3.13), so the session's own state decides, with a deadline.
        """
        deadline = time.monotonic() + self.options.save_timeout_s
        while (inflight := self._session.current()) is not None:
            self._check_background()
            if time.monotonic() > deadline:
                self._raise_failed(
                    TimeoutError(f"step {inflight.step} neither committed nor failed")
                )
            time.sleep(0.02)

    def _check_background(self) -> None:
        if self._checkpointer is None:
            return
        try:
            self._checkpointer.check_for_errors()
        except Exception as e:
            self._raise_failed(e)

    def _raise_failed(self, e: Exception) -> NoReturn:
        inflight = self._session.end(failed=True)
        step = inflight.step if inflight else None
        fenced = _fence_error(e) or self._fenced_now(step)
        if fenced is not None:
            self._fenced = fenced
            raise fenced from e
        if isinstance(e, TimeoutError):
            raise SaveTimeoutError(
                f"save of step {step} under {self.root} did not commit within "
                f"{self.options.save_timeout_s:.0f}s: {e}"
            ) from e
        raise SaveFailedError(
            f"background save of step {step} under {self.root} failed: {e}"
        ) from e

    def _fenced_now(self, step: int | None) -> WriterFencedError | None:
        """A newer writer took over (its garbage collection may be why a save failed)."""
        try:
            self._protocol.check_fence(f"commit step {step}")
        except WriterFencedError as e:
            return e
        except CheckpointError:
            pass  # the store is failing: report the save's own error
        return None

    def save_stats(self) -> list[SaveStats]:
        """Telemetry of the recent committed saves, oldest first.

        With a local tier, ``total_s`` is the time to the local commit and
        ``durable_s`` the time until the step was committed on the durable root
        (None while it is not, or when the promote policy did not choose it).
        """
        durable = self._durable
        if durable is not None:
            for stats in self._recorder.history():
                if stats.durable_s is None and stats.started:
                    when = durable.durable_time(stats.step)
                    if when is not None:
                        self._recorder.durable(stats.step, when)
        return self._recorder.history()

    def wait_durable(self, step: int | None = None, timeout_s: float | None = None) -> int | None:
        """With a local tier: blocks until ``step`` is committed on the durable root.

        Args:
          step: a step chosen for promotion; None waits for the newest step
            this manager asked to promote (or returns the newest durable step
            when it asked for none).
          timeout_s: how long to wait; None means ``save_timeout_s``.

        Returns:
          The durable step waited for (None: nothing durable and nothing asked).

        Raises:
          PromotionError: the step cannot be promoted (a damaged local copy, a
            fenced job, or it is neither local nor durable).
          PromotionTimeoutError: not durable within ``timeout_s``.
          CheckpointError: the manager has no local tier.
        """
        if self._durable is None:
            raise CheckpointError(f"the manager of {self.root} has no local tier (local_root)")
        self.wait()  # the local commit comes first
        timeout = self.options.save_timeout_s if timeout_s is None else timeout_s
        return self._durable.wait_durable(step, timeout)

    # -- reading -------------------------------------------------------------

    def steps(self, tier: str | None = None) -> list[int]:
        """Committed steps, ascending (the primary's view, on every process).

        On several processes this is collective: call it on every process.

        Args:
          tier: with a local tier, ``"local"`` or ``"durable"`` lists one tier;
            None lists every restorable step of either.
        """
        steps: set[int] = set()
        for name, protocol, _ in self._tiers(tier):
            if name == "local" and self._durable is not None:
                steps |= local_everywhere(self._agreement, protocol.committed())
            else:
                steps.update(protocol.committed())
        return list(self._agreement.agree("steps", sorted(steps)))

    def latest_step(self) -> int | None:
        """The newest committed step of any tier, or None (reads the newest markers only).

        On several processes this is collective: call it on every process.
        """
        if self._durable is not None:
            local = local_everywhere(self._agreement, self._protocol.committed())
            durable = self._durable.protocol.latest() if self._primary else None
            steps = local | ({durable.step} if durable is not None else set())
            return self._agreement.agree("latest", max(steps, default=None))
        markers = [p.latest() for _, p, _ in self._tiers(None)]
        newest = max((m.step for m in markers if m is not None), default=None)
        return self._agreement.agree("latest", newest)

    def _tiers(self, tier: str | None) -> list[tuple[str, CommitProtocol, StepReader]]:
        """``(name, protocol, reader)`` of the tiers ``tier`` names, nearest first."""
        if self._durable is None:
            if tier not in (None, "durable"):
                raise ValueError(f"the manager of {self.root} has no {tier!r} tier")
            return [("durable", self._protocol, self._reader)]
        tiers = [
            ("local", self._protocol, self._reader),
            ("durable", self._durable.protocol, self._durable.reader),
        ]
        if tier is None:
            return tiers
        chosen = [t for t in tiers if t[0] == tier]
        if not chosen:
            raise ValueError(f"tier must be None, 'local' or 'durable', got {tier!r}")
        return chosen

    def restore(
        self,
        step: int | None = None,
        *,
        target: Any = None,
        partial: bool = False,
        rename: PathMap | None = None,
        allow_lossy_cast: bool | None = None,
    ) -> Any:
        """Restores a committed step (the newest by default).

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
          allow_lossy_cast: ``target`` may convert arrays to dtypes that cannot hold
            every saved value (float32 -> float16); None: ``options.allow_lossy_cast``.
            Lossless conversions (widening, int16 -> float32) always happen.

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
        if allow_lossy_cast is None:
            allow_lossy_cast = self.options.allow_lossy_cast
        how = {"partial": partial, "rename": rename, "allow_lossy_cast": allow_lossy_cast}
        if self._durable is not None:
            return TieredRestore(
                self._protocol,
                self._reader,
                self._durable,
                self._agreement,
                primary=self._primary,
                fallback_on_corrupt=self.options.fallback_on_corrupt,
                read=lambda marker, protocol, reader: self._read_step(
                    marker, protocol, reader, target, how
                ),
            ).restore(None if step is None else _check_step(step))
        if step is not None:
            return self._restore_step(_check_step(step), target, how)
        committed: set[int] = set()
        for _, protocol, _ in self._tiers(None):
            committed.update(protocol.committed())
        candidates = self._agreement.agree("restore", sorted(committed)[::-1])
        if not candidates:
            raise StepNotFoundError(f"no committed steps under {self._where_all()}")
        for i, s in enumerate(candidates):
            try:
                return self._restore_step(s, target, how)
            except StepNotFoundError:
                continue  # deleted since the listing: try the next one
            except CorruptCheckpointError as error:
                if not self.options.fallback_on_corrupt or i == len(candidates) - 1:
                    raise
                log.warning(
                    "step %d is corrupt (%s); falling back to step %d", s, error, candidates[i + 1]
                )
        raise StepNotFoundError(f"no committed step under {self._where_all()} could be restored")

    def _read_step(
        self,
        marker: CommitMarker,
        protocol: CommitProtocol,
        reader: StepReader,
        target: Any,
        how: dict[str, Any],
    ) -> Any:
        step = marker.step
        with self._lock:
            self._restoring.add(step)
        try:
            return reader.restore(load_step(protocol, marker), target, **how)
        except CorruptCheckpointError as e:
            if not protocol.still_committed(marker):
                raise StepNotFoundError(
                    f"step {step} under {protocol.storage.uri} was deleted while it was being "
                    "restored"
                ) from e
            raise
        finally:
            with self._lock:
                self._restoring.discard(step)

    def _where_all(self) -> str:
        return " or ".join(p.storage.uri for _, p, _ in self._tiers(None))

    def _restore_step(self, step: int, target: Any, how: dict[str, Any]) -> Any:
        """Restores ``step`` from the nearest tier holding an intact copy.

        A local copy that is missing or corrupt falls back to the durable one.
        """
        tiers = self._tiers(None)
        error: CheckpointError | None = None
        for n, (name, protocol, reader) in enumerate(tiers):
            try:
                marker = self._agreed_marker(step, protocol)
                return self._restore_agreed(marker, target, how, protocol, reader)
            except (StepNotFoundError, CorruptCheckpointError) as e:
                if n == len(tiers) - 1:
                    if error is None or isinstance(e, CorruptCheckpointError):
                        raise
                    raise error from e
                if isinstance(e, CorruptCheckpointError):
                    log.warning(
                        "the %s copy of step %d is corrupt (%s); reading the %s copy",
                        name,
                        step,
                        e,
                        tiers[n + 1][0],
                    )
                    error = e
        raise AssertionError("unreachable")

    def _agreed_marker(self, step: int, protocol: CommitProtocol | None = None) -> CommitMarker:
        """The primary's marker of ``step`` (its attempt and checksums), on every process."""
        protocol = self._protocol if protocol is None else protocol
        if jax.process_count() == 1:
            return protocol.require_marker(step)
        kind, data = None, None
        if self._primary:
            try:
                data = protocol.require_marker(step).to_bytes().decode()
            except CheckpointError as e:
                kind, data = type(e).__name__, str(e)
        kind, data = self._agreement.agree("marker", [kind, data])
        if kind is not None:  # the primary's error, of the same class, on every process
            error_class = getattr(errors, kind, CheckpointError)
            raise error_class(data)
        return CommitMarker.from_bytes(data.encode(), f"commit marker of step {step}")

    def _restore_agreed(
        self,
        marker: CommitMarker,
        target: Any,
        how: dict[str, Any],
        protocol: CommitProtocol,
        reader: StepReader,
    ) -> Any:
        # Each process reads only its own regions, so one may find a corrupt
        # chunk that the others never read: all fail (and fall back) together.
        step = marker.step
        with self._lock:
            self._restoring.add(step)
        try:
            restored, error = (
                reader.restore(
                    load_step(protocol, marker), target, agreement=self._agreement, **how
                ),
                None,
            )
        except CorruptCheckpointError as e:
            restored, error = None, e
        finally:
            with self._lock:
                self._restoring.discard(step)
        if error is not None and not protocol.still_committed(marker):
            raise StepNotFoundError(
                f"step {step} under {protocol.storage.uri} was deleted while it was being restored"
            ) from error
        if not self._agreement.any_true("restore-corrupt", error is not None):
            return restored
        raise error or CorruptCheckpointError(
            f"step {step} under {protocol.storage.uri} is corrupt in a region another process read"
        )

    def metadata(self, step: int) -> StepMetadata:
        """The user metadata and a description of the saved tree of ``step``."""
        protocol = self._holder(_check_step(step))
        marker = protocol.require_marker(step)
        loaded = load_step(protocol, marker)
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
        protocol = self._holder(_check_step(step))
        context = self._context if protocol is self._protocol else self._durable_context()
        return verify_step(protocol, context, step, on_progress=on_progress)

    def _holder(self, step: int) -> CommitProtocol:
        """The nearest tier's protocol that has ``step`` committed (else the save tier's)."""
        for _, protocol, _ in self._tiers(None):
            if step in protocol.visible_refs():
                return protocol
        return self._protocol

    def _durable_context(self) -> ts.Context:
        assert self._durable is not None
        return self._durable.context

    # -- retention -----------------------------------------------------------

    def explain(self) -> dict[int, tuple[str, ...]]:
        """For every committed step, the rules that keep it (empty: would be deleted)."""
        decision = self._retention_decision()
        return {s: decision.keep.get(s, ()) for s in sorted(self._protocol.committed())}

    def _retention_decision(self) -> policy.RetentionDecision:
        with self._lock:
            protected = set(self._restoring)
        inflight = self._session.current()
        if inflight is not None:
            protected.add(inflight.step)
        rule = self.options.retention
        if self._durable is not None:  # the local tier: keep what still waits for promotion
            rule = self.options.local_retention
            protected |= self._durable.pending_steps()
        return retention_decision(self._protocol.committed(), rule, protected=protected)

    def _apply_retention(self) -> None:
        try:
            for step in self._retention_decision().delete:
                log.info("retention: deleting step %d under %s", step, self._storage.uri)
                self._protocol.delete(step)
            if self._durable is not None and self._primary:  # only the primary deletes there
                self._durable.apply_retention()
        except WriterFencedError as e:
            self._fenced = e
            log.error("retention under %s stopped: %s", self.root, e)
        except Exception:
            log.exception(
                "retention under %s failed; it will be retried after the next save", self.root
            )

    def _committed(self, marker: CommitMarker) -> None:
        """After a commit: the primary's (every host's on its own local tier)."""
        if self._durable is not None:
            self._durable.wake()  # a request written with the save may wait
        if self.options.retention is None and self.options.local_retention is None:
            return
        self._deletion = self._deleter.submit(self._apply_retention)

    def wait_for_deletions(self, timeout_s: float | None = None) -> None:
        """Blocks until background retention deletions have finished."""
        if self._deletion is not None:
            self._deletion.result(timeout=timeout_s)

    # -- deleting ------------------------------------------------------------

    def delete(self, step: int) -> None:
        """Deletes a committed step (marker first, then data); with a local tier, from both.

        Raises:
          StepNotFoundError: no such step.
          CheckpointError: the step is being saved.
          WriterFencedError: another process took over the root.
        """
        self._check_writable()
        inflight = self._session.current()
        if inflight is not None and inflight.step == _check_step(step):
            raise CheckpointError(f"step {step} is being saved; wait() before deleting it")
        if self._durable is None:
            self._protocol.delete(step)
            return
        holders = [p for _, p, _ in self._tiers(None) if step in p.visible_refs()]
        if not holders:
            self._protocol.require_marker(step)  # raises StepNotFoundError listing the steps
        from jaxckpt._promote import withdraw

        withdraw(self._protocol, step)  # never promote a deleted step
        for protocol in holders:
            if protocol is self._protocol or self._primary:  # the primary deletes durable steps
                protocol.delete(step)

    def garbage_collect(
        self, *, older_than_s: float | None = None, force: bool = False
    ) -> list[int]:
        """Removes partial, orphaned and fenced attempts; returns their steps.

        Args:
          older_than_s: attempts of the current epoch younger than this are kept
            (default ``gc_grace_s``); this manager's own in-flight save always is.
          force: also remove damaged commit markers and their steps' data.
        """
        self._check_writable()
        if self._session.current() is not None:
            self.wait()
        self._protocol.check_fence("collect garbage")
        grace = self.options.gc_grace_s if older_than_s is None else older_than_s
        found = _gc.scan(self._protocol, full=True)
        removed = _gc.collect(self._protocol, found, grace_s=grace, force=force)
        return sorted({loc.step for loc in removed})

    # -- lifecycle -----------------------------------------------------------

    def close(self) -> None:
        """Waits for the in-flight save and releases resources. Idempotent.

        After a ``KeyboardInterrupt`` in ``wait()`` it still waits for the
        in-flight save: it returns once the step committed, or raises.

        Raises:
          SaveFailedError: the in-flight save failed and did not commit.
          SaveTimeoutError: it did not commit within ``save_timeout_s``.
          WriterFencedError: another process took over the root.
        """
        if self._closed:
            return
        try:
            self.wait()  # after an interrupted wait() too: commits or raises
        finally:
            self._closed = True
            if self._durable is not None:  # bounded; "external" promotion is not waited for
                self._durable.close(self.options.save_timeout_s)
            if self._checkpointer is not None:
                self._checkpointer.close()
            self._deleter.shutdown(wait=True)
            if self._watcher is not None:
                self._watcher.close()
            self._agreement.close()

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
        if self._fenced is not None:
            raise self._fenced


_opened: dict[str, int] = {}
_opened_lock = threading.Lock()


def _namespace(root: str) -> str:
    """Agreement keys of the n-th manager of ``root`` in this process (same on every host)."""
    with _opened_lock:
        n = _opened[root] = _opened.get(root, -1) + 1
    return f"{zlib.crc32(root.encode()):08x}.{n}"


def _fence_error(e: BaseException) -> WriterFencedError | None:
    """The WriterFencedError behind ``e`` (Orbax wraps background errors), if any."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, WriterFencedError):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


def _wants_preemption(save_policy: Any) -> bool:
    parts = save_policy.policies if isinstance(save_policy, policy.AnySave) else (save_policy,)
    return any(isinstance(p, policy.OnPreemption) for p in parts)
