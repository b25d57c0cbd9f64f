"""The health methods of :class:`jaxckpt.CheckpointManager`: marks, the newest good
step, rollback and preemption notices (a base class of the manager,
beside :class:`~jaxckpt.records._procstate.ProcessStateAccess`; the logic is
:class:`jaxckpt.health.Health`)."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from jaxckpt.commit import Agreement
from jaxckpt.health._verdicts import Health
from jaxckpt.records import check_step
from jaxckpt.restoring import Selection

if TYPE_CHECKING:
    from jaxckpt._preemption import PreemptionWatcher
    from jaxckpt.saving import SaveSession


class HealthAccess:
    """Step health on a manager (which sets ``_health``, ``_select``, ``_agreement``)."""

    _health: Health
    _select: Selection
    _agreement: Agreement
    _session: SaveSession
    _watcher: PreemptionWatcher | None
    _clean_exit = True
    """False once the manager's ``with`` block ended with an exception (not a clean exit)."""
    wait: Callable[[], None]
    restore: Callable[..., Any]

    @property
    def failed_saves(self) -> int:
        """Background saves that failed without ``save()`` raising (``tolerate_failed_saves``)."""
        return self._session.failures.count

    def preempted(self, step: int = 0) -> bool:
        """True once SIGTERM/SIGINT or JAX's preemption notice came (``policy.OnPreemption``)."""
        preempted = self._watcher is not None and self._watcher.preempted(step)
        if preempted:
            self._health.ended("preempted")  # this run never counts toward a crash loop
        return preempted

    def latest_good_step(self) -> int | None:
        """The newest committed step not marked bad, or None (collective)."""
        with self._agreement.operation("latest-good"):
            bad = self._health.plan(None, restoring=False).bad
            return next((s for s in reversed(self._select.steps()) if s not in bad), None)

    def rollback(self, target: Any = None, **kwargs: Any) -> Any:
        """Restores the newest good step older than the step last saved or restored (the
        newer ones are marked bad and may be saved again); ``restored_process_state``
        rolls back with it. For a loop: ``if not math.isfinite(loss): state =
        mgr.rollback(target)``. Collective. ``kwargs``: as ``restore``.

        Raises:
          StepNotFoundError: no good step is older (or nothing was saved or restored).
          CorruptCheckpointError: every older good step is corrupt.
        """
        with self._agreement.operation("rollback"):
            self.wait()
            steps = self._select.steps()
            restore = lambda s: self.restore(s, target=target, **kwargs)  # noqa: E731
            return self._health.rollback(restore, steps)

    def mark(self, step: int, *, good: bool, reason: str = "") -> None:
        """Marks ``step`` good or bad by hand: a new record beside it, with time and host
        (the newest mark wins, so it is reversible; the step's data is untouched).
        ``restore()`` skips bad steps. The primary writes it.

        Raises:
          StepNotFoundError: no such committed step.
          CheckpointError: the manager is read-only or closed.
        """
        self._session.check_writable()
        self._health.mark(check_step(operator.index(step)), good, reason)
