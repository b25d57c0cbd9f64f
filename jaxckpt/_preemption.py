"""Preemption notices: SIGTERM/SIGINT and JAX's preemption sync point.

A :class:`PreemptionWatcher` turns a signal into a flag that the save policy
reads (``OnPreemption``), so the training loop saves at the next step
boundary and can then exit cleanly. SIGINT (Ctrl-C) sets the flag and still
interrupts: the handler it replaced runs too (by default, ``KeyboardInterrupt``).
The handlers it replaces are restored by :meth:`PreemptionWatcher.close`.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

log = logging.getLogger("jaxckpt")


class PreemptionWatcher:
    """Sets :attr:`preempted` when the process is told to stop."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
        self._event = threading.Event()
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            log.warning("preemption signals can only be watched from the main thread")
            return
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    @classmethod
    def for_policy(cls, save_policy: Any) -> PreemptionWatcher | None:
        """A watcher when ``save_policy`` includes ``policy.OnPreemption()``, else None."""
        from jaxckpt import policy

        parts = save_policy.policies if isinstance(save_policy, policy.AnySave) else (save_policy,)
        if not any(isinstance(p, policy.OnPreemption) for p in parts):
            return None
        if _jax_syncs():  # SIGTERM is JAX's: every host learns of it at one agreed step
            return cls(signals=(signal.SIGINT,))
        return cls()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._event.set()
        if signum != signal.SIGINT:
            log.warning("received %s: the next step will be saved", signal.Signals(signum).name)
            return
        previous = self._previous.get(signum)
        log.warning("received SIGINT: preempted, and interrupting")
        if callable(previous):  # Ctrl-C is never swallowed: by default KeyboardInterrupt
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            raise KeyboardInterrupt

    def notify(self) -> None:
        """Marks the process as preempted (for schedulers with their own notice)."""
        self._event.set()

    @property
    def noticed(self) -> bool:
        """A notice arrived (without asking JAX's sync point)."""
        return self._event.is_set()

    def preempted(self, step: int) -> bool:
        """True once a notice arrived; also asks JAX's preemption sync point."""
        if self._event.is_set():
            return True
        if _jax_sync_point(step):
            self._event.set()
        return self._event.is_set()

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def notices_alike(save_policy: Any) -> bool:
    """Whether every process answers ``save_policy`` alike by itself (no agreement per step).

    True on one process, and for a policy of steps (``EveryNSteps``, ``AtSteps``) and
    ``OnPreemption`` when the notice is JAX's preemption sync point, which every process
    reaches at the same step (a SIGINT on one process interrupts it at once: its notice
    decides no save of the others). A policy of time or measured costs is agreed.
    """
    import jax

    from jaxckpt import policy

    if jax.process_count() == 1 or save_policy is None:
        return True
    parts = save_policy.policies if isinstance(save_policy, policy.AnySave) else (save_policy,)
    steps = (policy.EveryNSteps, policy.AtSteps, policy.OnPreemption)
    if not all(type(p) in steps for p in parts):
        return False
    return not any(isinstance(p, policy.OnPreemption) for p in parts) or _jax_syncs()


def _jax_syncs() -> bool:
    """Whether JAX's multi-host preemption service runs here. Its notifier handles
    SIGTERM and makes every process reach the sync point at the same step; a handler
    of this process's own would replace it, and each host would then see the notice at
    its own step: one host stops while the others wait for it in a collective."""
    try:
        from jax._src import distributed
    except ImportError:  # pragma: no cover - very old jax
        return False
    return getattr(distributed.global_state, "preemption_sync_manager", None) is not None


def _jax_sync_point(step: int) -> bool:
    """JAX's multi-host preemption sync point, when the distributed service runs."""
    try:
        from jax._src import distributed
        from jax.experimental import multihost_utils
    except ImportError:  # pragma: no cover - very old jax
        return False
    if getattr(distributed.global_state, "preemption_sync_manager", None) is None:
        return False
    return bool(multihost_utils.reached_preemption_sync_point(step))
