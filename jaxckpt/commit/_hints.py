"""Each writer epoch's newest-step hint, ``commits/latest.e<epoch>``. Imports no jax.

A writer raises its epoch's hint before each marker and never lowers it, so
:meth:`jaxckpt.commit._protocol.CommitProtocol.latest` reads one marker instead of
listing them all. Only the epoch's writer writes its hint, so that writer
remembers the value it last read or wrote (a new epoch has none), and a commit
that knows its step is newer raises the hint without reading it first.
"""

from __future__ import annotations

from collections.abc import Callable

from jaxckpt.records import latest_hint_key
from jaxckpt.storage import Storage


class Hints:
    """Reads and raises the hints of one root, remembering those of the writer's epoch.

    Args:
      storage: the root.
      own: the writer's epoch now (None: not a writer).
    """

    def __init__(self, storage: Storage, own: Callable[[], int | None]) -> None:
        self._storage = storage
        self._own = own
        self._known: dict[int, int] = {}

    def taken(self, epoch: int) -> None:
        """This writer took ``epoch`` just now: nobody has written its hint."""
        self._known[epoch] = -1

    def known_lower(self, epoch: int, step: int) -> bool:
        """Whether this writer knows its own epoch's hint is below ``step``."""
        return epoch == self._own() and self._known.get(epoch, step) < step

    def read(self, epoch: int) -> int | None:
        """The epoch's hint, or None (none written, or unreadable)."""
        raw = self._storage.read(latest_hint_key(epoch))
        text = raw.decode(errors="replace").strip() if raw else ""
        hinted = int(text) if text.isdigit() else None
        if hinted is not None and epoch == self._own():
            self._known[epoch] = max(hinted, self._known.get(epoch, hinted))
        return hinted

    def raise_to(self, epoch: int, step: int) -> int:
        """Writes ``step`` as the epoch's hint; returns it."""
        self._storage.write(latest_hint_key(epoch), str(step).encode())
        if epoch == self._own():
            self._known[epoch] = step
        return step
