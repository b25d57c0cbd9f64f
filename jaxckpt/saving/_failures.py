"""A failed save as the user sees it: the error it raises, or, within
``CheckpointOptions.tolerate_failed_saves`` failures in a row, a logged and counted
failure training goes on after (the next save the policy takes tries again).

Every process sees the same failure (the hosts agree on each save's outcome), so every
process tolerates it, or raises it, alike. The failed step is withdrawn from promotion,
and a process whose own tier was full (ENOSPC, EDQUOT) first asks the session's
listeners to make room there (retention keeps only the newest step): the next save has
the space of the steps deleted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from jaxckpt.errors import CheckpointError, SaveFailedError, SaveTimeoutError
from jaxckpt.saving._helpers import behind
from jaxckpt.storage import no_space

log = logging.getLogger("jaxckpt")


def save_error(error: Exception, step: int | None, root: str, timeout_s: float) -> CheckpointError:
    """The error a background save's ``error`` raises (ours, under Orbax's wrapper)."""
    e = behind(error, CheckpointError) or error
    if isinstance(e, TimeoutError):
        return SaveTimeoutError(
            f"save of step {step} under {root} did not commit within {timeout_s:.0f}s: {e}"
        )
    return SaveFailedError(f"background save of step {step} under {root} failed: {e}")


class FailedSaves:
    """The failed saves of a session that training went on after.

    Args:
      allowed: ``tolerate_failed_saves``, failures in a row let pass.
      listeners: the session's listeners: after a failed save those with ``withdraw(step)``
        are told its step, and those with ``make_room()`` asked to free this process's tier
        when the save found it full.
    """

    def __init__(self, allowed: int, listeners: Callable[[], Sequence[Any]] = tuple) -> None:
        self.allowed = allowed
        self._listeners = listeners
        self.count = 0
        """Failures let pass, in all."""
        self.in_a_row = 0
        self.on_failed: Callable[[int, str], None] | None = None
        """Told ``(step, error)`` of each failure let pass (the ledger)."""

    def committed(self) -> None:
        """A save committed: the count in a row starts again."""
        self.in_a_row = 0

    def tolerates(
        self, failure: CheckpointError, step: int | None, cause: Exception, *, asked: bool
    ) -> bool:
        """Whether training goes on after ``failure`` (``asked``: the caller would; logged,
        counted and told if so); room is made first when ``cause`` is a full disk."""
        full = no_space(cause)
        for listener in self._listeners():
            withdraw = getattr(listener, "withdraw", None)  # promotion: a failed step never
            if withdraw is not None and step is not None:  # is (its lost check would fail)
                withdraw(step)
            make_room = getattr(listener, "make_room", None)
            if make_room is not None and full:
                make_room()
        if not asked or self.in_a_row >= self.allowed:
            return False
        self.in_a_row += 1
        self.count += 1
        log.error(
            "%s (failed save %d in a row of %d tolerated: training goes on, step %s is not "
            "committed, the next save tries again)",
            failure,
            self.in_a_row,
            self.allowed,
            step,
        )
        if self.on_failed is not None and step is not None:
            self.on_failed(step, f"{type(failure).__name__}: {failure}")
        return True
