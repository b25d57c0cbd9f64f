"""Save telemetry: blocking seconds, write seconds, bytes and throughput.

Kept beside the manager's logic rather than inside it: the manager calls
:meth:`SaveRecorder.started`, :meth:`blocked` and :meth:`committed`, and this
module does the clock arithmetic and the logging.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, replace

log = logging.getLogger("jaxckpt")


@dataclass(frozen=True, kw_only=True)
class SaveStats:
    """What one committed save cost.

    Attributes:
      step: the step saved.
      blocking_s: seconds ``save`` blocked the caller.
      total_s: seconds from the call to ``save`` until the commit marker was written.
      nbytes: array bytes this process wrote (chunk payloads and checksums).
      started: wall-clock time of the call to ``save``.
      durable_s: with a local tier, seconds from the call to ``save`` until the
        step was committed on the durable root (None: not durable, or not tiered;
        then ``total_s`` is the time to the local commit).
    """

    step: int
    blocking_s: float
    total_s: float
    nbytes: int
    started: float = 0.0
    durable_s: float | None = None

    @property
    def throughput_bps(self) -> float:
        """Bytes per second from the start of the save until its commit."""
        return self.nbytes / self.total_s if self.total_s > 0 else 0.0


def human_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``.

    >>> human_bytes(3 * 1024**3)
    '3.0 GiB'
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class SaveRecorder:
    """Collects :class:`SaveStats` for the saves of one manager (thread-safe)."""

    def __init__(self, history: int = 64) -> None:
        self._lock = threading.Lock()
        self._open: dict[int, tuple[float, float | None]] = {}
        self._wall: dict[int, float] = {}
        self._early: dict[int, float] = {}  # committed before save() returned: their starts
        self._done: deque[SaveStats] = deque(maxlen=history)

    def started(self, step: int) -> float:
        now = time.perf_counter()
        with self._lock:
            self._open[step] = (now, None)
            self._wall[step] = time.time()
        return now

    def blocked(self, step: int) -> float:
        """Marks the end of the blocking part; returns the blocking seconds."""
        with self._lock:
            if step not in self._open:  # a local tier committed before save() returned
                start = self._early.pop(step)
                blocking = time.perf_counter() - start
                for i, stats in enumerate(self._done):
                    if stats.step == step:
                        self._done[i] = replace(stats, blocking_s=blocking)
                return blocking
            start, _ = self._open[step]
            blocking = time.perf_counter() - start
            self._open[step] = (start, blocking)
        return blocking

    def committed(self, step: int, nbytes: int) -> SaveStats:
        with self._lock:
            start, blocking = self._open.pop(step)
            if blocking is None:
                self._early[step] = start
            stats = SaveStats(
                step=step,
                blocking_s=blocking or 0.0,
                total_s=time.perf_counter() - start,
                nbytes=nbytes,
                started=self._wall.pop(step, 0.0),
            )
            self._done.append(stats)
        log.info(
            "committed step %d: %s in %.2fs (%s/s), blocked %.3fs",
            step,
            human_bytes(nbytes),
            stats.total_s,
            human_bytes(stats.throughput_bps),
            blocking or 0.0,
        )
        return stats

    def failed(self, step: int) -> None:
        with self._lock:
            self._open.pop(step, None)
            self._wall.pop(step, None)
            self._early.pop(step, None)

    def durable(self, step: int, when: float) -> None:
        """Records that ``step`` was committed on the durable tier at wall-clock ``when``."""
        with self._lock:
            for i, stats in enumerate(self._done):
                if stats.step == step and stats.durable_s is None and stats.started:
                    self._done[i] = replace(stats, durable_s=max(0.0, when - stats.started))

    def history(self) -> list[SaveStats]:
        with self._lock:
            return list(self._done)
