"""The save session: the in-flight save, the Orbax checkpointer and the save's outcome.

:meth:`SaveSession.save` checks the step, describes the state and hands it
to Orbax's ``AsyncCheckpointer``, whose handler then calls
:meth:`SaveSession.begin` (primary host, blocking part: nothing left to do),
:meth:`SaveSession.write` (every host, background thread) and
:meth:`SaveSession.commit` (primary host, at Orbax's finalize: ends the session).
``write`` is where the step is written and committed: a
:class:`~jaxckpt.saving._stepwrite.StepWrite` writes this process's part, the
hosts agree that every part is written, and the primary of a shared tier (or
each host of its own local tier, after the step's promotion request) writes
the marker; a second agreement tells every host the commit's outcome. The
session knows the attempt's :class:`~jaxckpt.records.StepLocation`, so every
key of the save comes from one place. It owns the checkpointer and the wait,
failure and fence state. A commit notifies its listeners (retention,
promotion), never the manager.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax

from jaxckpt import policy
from jaxckpt._options import CheckpointOptions
from jaxckpt._preemption import notices_alike
from jaxckpt.commit import Agreement, Listing
from jaxckpt.errors import (
    CheckpointError,
    SaveFailedError,
    StorageError,
    WriterFencedError,
)
from jaxckpt.formats import HostArray, StepWriter, format_named
from jaxckpt.formats.writers import step_writer
from jaxckpt.records import (
    CommitMarker,
    PromotionRequest,
    SavedLeaf,
    StepLocation,
    encode_process_state,
    withdraw,
)
from jaxckpt.saving import _atexit, _handler
from jaxckpt.saving._failures import FailedSaves, save_error
from jaxckpt.saving._helpers import fence_error
from jaxckpt.saving._meet import Meetings
from jaxckpt.saving._stepwrite import Inflight, StepWrite, prepare_step
from jaxckpt.saving._telemetry import SaveRecorder
from jaxckpt.tiers import Tier

log = logging.getLogger("jaxckpt")


class CommitListener(Protocol):
    """Told after each commit of this process (retention, promotion)."""

    def committed(self, marker: CommitMarker) -> None: ...


class SaveSession:
    """The in-flight save of one manager, shared with the Orbax handler.

    Args:
      tier: the tier saves commit to (the nearest).
      options: the manager's options.
      agreement: the manager's (the attempt, the tree record).
      where: the manager's root (the durable one), for messages and the packs' write budget.
      listeners: told after each commit of this process.
    """

    def __init__(
        self,
        tier: Tier,
        options: CheckpointOptions,
        agreement: Agreement,
        where: str,
        *,
        listeners: Sequence[CommitListener] = (),
    ) -> None:
        self._tier, self._protocol, self._arrays = tier, tier.protocol, tier.arrays
        self.recorder = SaveRecorder()
        self._options = options
        self._alike = notices_alike(options.save_policy)  # no agreement per declined step
        self._agreement, self._meetings, self._root = agreement, Meetings(agreement), where
        self._primary = jax.process_index() == options.primary_host
        self._listeners = tuple(listeners)
        self._writer: StepWriter = step_writer(
            format_named(options.layout), tier, options, budget_uri=where
        )  # packs sized for the durable root: a local tier's reach it unchanged
        self._commits = tier.commit_point
        self._lock = threading.Lock()
        self._inflight: Inflight | None = None
        self._checkpointer: Any = None
        self._last_saved: tuple[int | None, float | None] | None = None
        self._background: Agreement | None = None  # the last save's background agreement
        self.corrupt: set[int] = set()
        """Steps a restore found corrupt on every host: a save of one replaces it."""
        self.fenced: WriterFencedError | None = None
        """Set once a newer writer took over: nothing more commits."""
        self.closed = False
        self.failures = FailedSaves(
            options.tolerate_failed_saves, lambda: (*self._listeners, self._tier.peers)
        )

    # -- the manager's side ------------------------------------------------------

    def policy_says_save(
        self, step: int, preempted: Callable[[int], bool], latest: Callable[[], int | None]
    ) -> bool:
        """Whether the save policy saves ``step`` now (the primary's answer)."""
        save_policy = self._options.save_policy
        if save_policy is None:
            return True
        if self._last_saved is None:
            self._last_saved = (latest(), None)
        last_step, last_time = self._last_saved
        ctx = policy.SaveContext(
            step=step,
            now=time.monotonic(),
            last_saved_step=last_step,
            last_save_time=last_time,
            preempted=preempted(step),
            blocking_seconds=tuple(s.blocking_s for s in self.recorder.history()[-8:]),
        )
        says = bool(save_policy.should_save(ctx))
        return says if self._alike else bool(self._agreement.agree("save", says))

    def save(
        self,
        step: int,
        state: Any,
        metadata: Any,
        metrics: dict[str, float] | None,
        keep: bool,
        request: Callable[[int], PromotionRequest | None],
        process_state: Any = None,
        lost: CheckpointError | None = None,
    ) -> bool:
        """Starts the save of ``step`` (see ``CheckpointManager.save``); False: its checks
        failed on the store (a full local disk) and :class:`FailedSaves` let it pass.

        Every process's local checks (its tier, its leaves, the step's absence and
        the fence where this process looks) are agreed before any collective: when
        one fails, every process raises, naming it, and none enters Orbax's save.
        ``lost``: steps this process found can no longer be promoted, told at the checks.
        """
        if self._background is not None:  # every process waited for it before this save
            self._agreement.forget(self._background)
            self._background = None
        prepared: tuple[Any, Any, bytes, StepLocation, Listing | None, bool] | None = None
        failure: Exception | None = None
        try:
            if lost is not None:
                raise lost
            if callable(process_state):  # taken now that the step is saved (``it.get_state``)
                process_state = process_state()
            own_state = encode_process_state(process_state, step=step, process=jax.process_index())
            prepared = prepare_step(
                self._tier,
                self._options,
                step,
                state,
                metadata,
                begins=self._commits.begins(primary=self._primary),
                corrupt=self.corrupt,
                root=self._root,
                ready=self._ensure_checkpointer,
            )
        except Exception as e:
            failure = e
        announced = prepared is not None and prepared[5]
        try:
            self._agreement.settle(
                "checks", failure, what=f"save of step {step} under {self._root}"
            )
            assert prepared is not None
            leaves, values, tree, loc, listing, announced = prepared
            loc, tree = self._commits.agree(self._agreement, loc, tree)
            promotion = request(step)
        except BaseException as e:
            if prepared is not None and (announced or self._commits.per_host):
                with contextlib.suppress(Exception):  # else collected as a stale attempt
                    self._protocol.storage.delete(prepared[3].pending_key)
            if isinstance(e, StorageError) and self.failures.tolerates(e, step, e, asked=True):
                return False  # every process alike (the checks are agreed)
            raise
        inflight = Inflight(
            loc=loc,
            tree=tree,
            metrics=metrics,
            keep=keep,
            request=promotion,
            listing=listing,
            announced=announced,
            agreement=self._agreement.detached(within_s=self._options.save_timeout_s),
            process_state=own_state,
        )
        self.start(inflight)
        self._meetings.begin(f"save of step {step} under {self._root}")
        returned = False
        try:
            self._checkpointer.save(
                _handler.orbax_step_path(step),
                args=_handler.SaveArgs(step=step, leaves=leaves, values=values),
            )
            returned = True
        except Exception as e:
            self._meetings.tell(e)  # the others wait at this process's next meeting
            self.end(failed=True)
            fenced = fence_error(e) or self._fenced_now(step)
            if fenced is not None:
                self.fenced = fenced
                raise fenced from e
            if isinstance(e, CheckpointError):
                raise
            raise SaveFailedError(f"save of step {step} under {self._root} failed: {e}") from e
        finally:  # the background write starts once the caller has its thread back
            inflight.release(abandoned=not returned)  # (or writes nothing)
        self.recorder.blocked(step)
        self._last_saved = (step, time.monotonic())
        return True

    def _ensure_checkpointer(self) -> Any:
        if self._checkpointer is None:
            self._checkpointer = _handler.make_checkpointer(
                self, self._options, per_host=self._commits.per_host, meetings=self._meetings
            )
        return self._checkpointer

    def wait(self, *, tolerate: bool = False) -> None:
        """Blocks until the in-flight save committed (``tolerate``: see :class:`FailedSaves`)."""
        if self.fenced is not None:
            raise self.fenced
        if self._checkpointer is None:
            return
        try:
            self._checkpointer.wait_until_finished()
        except Exception as e:
            self._failed(e, tolerate)
        if not self._primary and self.current() is not None:
            self.end(failed=False)  # Orbax's final barrier: the primary committed
        self._await_commit(tolerate)

    def _await_commit(self, tolerate: bool) -> None:
        """Waits until the in-flight save committed or failed: the session's own state
        decides, with a deadline (a ``KeyboardInterrupt`` during Orbax's ``Thread.join``
        can leave its thread looking finished to later joins, CPython < 3.13)."""
        deadline = time.monotonic() + self._options.save_timeout_s
        while (inflight := self.current()) is not None:
            self.check_background(tolerate=tolerate)
            if time.monotonic() > deadline:
                late = TimeoutError(f"step {inflight.step} neither committed nor failed")
                self._failed(late)
            time.sleep(0.02)

    def check_background(self, *, tolerate: bool = False) -> None:
        """Raises the background save's failure, if it failed, without waiting."""
        if self._checkpointer is None:
            return
        try:
            self._checkpointer.check_for_errors()
        except Exception as e:
            self._failed(e, tolerate)

    def _failed(self, error: Exception, tolerate: bool = False) -> None:
        """Raises the save's failure, unless ``tolerate`` and :class:`FailedSaves` let it
        pass (then returns); a fence always raises."""
        inflight = self.end(failed=True)
        step = inflight.step if inflight else None
        fenced = fence_error(error) or self._fenced_now(step)
        if fenced is not None:
            self.fenced = fenced
            raise fenced from error
        failure = save_error(error, step, self._root, self._options.save_timeout_s)
        if not self.failures.tolerates(failure, step, error, asked=tolerate):
            raise failure from error

    def _fenced_now(self, step: int | None) -> WriterFencedError | None:
        """A newer writer took over (its garbage collection may be why a save failed)."""
        try:
            self._protocol.check_fence(f"commit step {step}")
        except WriterFencedError as e:
            return e
        except CheckpointError:
            pass  # the store is failing: report the save's own error
        return None

    def fence(self, error: WriterFencedError) -> None:
        """Records that a newer writer took over (found by retention, say)."""
        self.fenced = error

    def check_writable(self) -> None:
        """Raises unless this session may start a save or delete now.

        Raises:
          CheckpointError: the manager is closed or read-only.
          WriterFencedError: a newer writer took over.
        """
        if self.closed:
            raise CheckpointError(f"the manager of {self._root} is closed")
        if self._options.read_only:
            raise CheckpointError(f"the manager of {self._root} is read-only")
        if self.fenced is not None:
            raise self.fenced

    def check_deletable(self, step: int) -> None:
        """Raises unless ``step`` may be deleted now (writable, and not being saved)."""
        self.check_writable()
        if step in self.current_steps():
            raise CheckpointError(f"step {step} is being saved; wait() before deleting it")

    def close(self) -> None:
        """Closes the checkpointer (and the handler's writer thread) and the tier's peers."""
        self.closed = True
        if self._checkpointer is not None:
            self._checkpointer.close()
        self._protocol.tidying.settle(self._options.save_timeout_s)
        self._tier.peers.close()

    # -- the session --------------------------------------------------------------

    def start(self, inflight: Inflight) -> None:
        with self._lock:
            if self._inflight is not None:
                raise CheckpointError(
                    f"{self._inflight.loc} is still in flight; wait() before the next save"
                )
            self._inflight = inflight
            self._background = inflight.agreement
        _atexit.track(self)
        self.recorder.started(inflight.step)

    def current(self) -> Inflight | None:
        with self._lock:
            return self._inflight

    def current_steps(self) -> set[int]:
        """The step in flight, if any (retention keeps it)."""
        inflight = self.current()
        return set() if inflight is None else {inflight.step}

    def listen(self, *listeners: CommitListener) -> None:
        """Adds components told after each commit of this process."""
        self._listeners += listeners

    def end(self, *, failed: bool) -> Inflight | None:
        """Forgets the in-flight save; a failed attempt of a single process is removed."""
        with self._lock:
            inflight, self._inflight = self._inflight, None
        _atexit.untrack(self)
        if inflight is not None and not failed:
            self.failures.committed()
        if inflight is not None and failed:
            self.recorder.failed(inflight.step)
            if self._commits.abandons(primary=self._primary):
                with contextlib.suppress(Exception):  # leftovers are collected anyway
                    removed = self._protocol.abandon(inflight.loc)  # kept if committed here
                    # Never promoted; on several hosts even if committed here (parts may lack)
                    several = jax.process_count() > 1
                    if (removed or several) and inflight.request is not None:
                        withdraw(self._protocol, inflight.step)
        return inflight

    def _expect(self, step: int) -> Inflight:
        inflight = self.current()
        if inflight is None or inflight.step != step:
            where = self._protocol.storage.uri
            raise CheckpointError(f"no save of step {step} is in flight under {where}")
        return inflight

    # -- SessionHooks (called by Orbax's handler and step path) ---------------

    def begin(self, step: int) -> None:
        """Orbax's create: nothing left to do (``save`` began the attempt, agreed)."""
        self._expect(step)

    def write(self, step: int, leaves: Sequence[SavedLeaf], arrays: Sequence[HostArray]) -> None:
        """Orbax's write: this process's part of the step, then its agreed commit, once
        ``save`` has returned (see :meth:`StepWrite.run`)."""
        inflight = self._expect(step)
        StepWrite(
            self._tier,
            self._writer,
            self._options,
            inflight.agreement or self._agreement,
            primary=self._primary,
            recorder=self.recorder,
            notify=self._notify,
            root=self._root,
        ).run(inflight, arrays)

    def commit(self, step: int) -> None:
        """Orbax's finalize: the step is committed (in ``write``, agreed by every host)."""
        self._expect(step)
        with self._lock:
            self._inflight = None
        _atexit.untrack(self)
        self.failures.committed()

    def finish_at_exit(self) -> None:
        """At interpreter exit: waits (bounded) for the save in flight, logging one line."""
        inflight = self.current()
        if inflight is not None and not self.closed:
            _atexit.finish(self.wait, inflight.step, self._root)

    def _notify(self, marker: CommitMarker) -> None:
        for listener in self._listeners:
            listener.committed(marker)
