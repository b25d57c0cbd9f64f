"""Committed steps' pending records, removed in the background. Imports no jax.

Once a step's marker is durable its pending record only has to go, not
before the save returns: removing it on a background thread takes a round
trip off every save. A crash before it went leaves a stale record, which
every garbage collection drops (see :mod:`jaxckpt.commit._gc`). A delete of the step
writes a record under the same key, so it waits for the save's to go first.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from concurrent.futures import wait as wait_for

from jaxckpt import _pools as pools
from jaxckpt.errors import StorageError
from jaxckpt.records import StepLocation
from jaxckpt.storage import Storage

log = logging.getLogger("jaxckpt")

BEFORE_DELETE_WAIT_S = 60.0
"""How long a delete of a step waits for the removal of the step's save record."""
TIDY_S = 60.0
"""How long a writer that ends soon after committing (``cp``, promotion) waits for the
pending records of its committed steps to go (a daemon removal dies with the process)."""


class Tidying:
    """The pending records of one root's committed steps that are still being removed."""

    def __init__(self, storage: Storage) -> None:
        self._storage = storage
        self._lock = threading.Lock()  # commits add, retention's deletes take
        self._removing: dict[StepLocation, Future[None]] = {}

    def drop(self, loc: StepLocation) -> None:
        """Removes the committed attempt ``loc``'s pending record in the background."""
        removing = pools.pool("tidy", 1).submit(self._remove, loc)
        with self._lock:
            self._removing = {at: f for at, f in self._removing.items() if not f.done()}
            self._removing[loc] = removing

    def _remove(self, loc: StepLocation) -> None:
        try:
            self._storage.delete(loc.pending_key)
        except StorageError as e:
            log.warning("step %d is committed; its pending record stays until gc: %s", loc.step, e)

    def before_delete(self, loc: StepLocation) -> None:
        """Waits (bounded) until ``loc``'s save record is gone, if it is being removed."""
        with self._lock:
            removing = self._removing.pop(loc, None)
        if removing is not None:
            wait_for([removing], timeout=BEFORE_DELETE_WAIT_S)

    def settle(self, timeout_s: float) -> None:
        """Waits, at most ``timeout_s``, until every record being removed is gone."""
        with self._lock:
            removing, self._removing = self._removing, {}
        _, late = wait_for(removing.values(), timeout=timeout_s)
        if late:
            log.warning(
                "%d pending records of committed steps under %s are still being removed",
                len(late),
                self._storage.uri,
            )
