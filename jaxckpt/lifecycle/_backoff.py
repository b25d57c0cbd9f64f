"""Exponential back-off with jitter, per key: how long to leave a failing thing alone.

The promoter keeps one :class:`Backoff` for the steps whose promotion failed:
after the n-th failure in a row a step is not tried again for
``min(longest, first * 2**(n-1))`` seconds, scaled by a random factor in
[0.5, 1) (so promoters of many hosts failing together spread out); a success
forgets the step. Imports nothing heavy.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Hashable


class Backoff:
    """Failure counts and retry instants, per key.

    Args:
      first_s: the wait after the first failure (before jitter).
      longest_s: the longest wait.
      clock: ``time.monotonic`` (a test passes its own).
      rng: the jitter's source of ``[0, 1)`` numbers.

    >>> b = Backoff(first_s=1.0, longest_s=4.0, clock=lambda: 100.0, rng=lambda: 0.0)
    >>> [b.failed("s") for _ in range(4)], b.due("s"), b.failures("s")
    ([0.5, 1.0, 2.0, 2.0], False, 4)
    >>> b.succeeded("s"); b.due("s"), b.failures("s")
    (True, 0)
    """

    def __init__(
        self,
        *,
        first_s: float,
        longest_s: float,
        clock: Callable[[], float] = time.monotonic,
        rng: Callable[[], float] = random.random,
    ) -> None:
        if not 0 < first_s <= longest_s:
            raise ValueError(f"need 0 < first_s <= longest_s, got {first_s}, {longest_s}")
        self._first, self._longest = first_s, longest_s
        self._clock, self._rng = clock, rng
        self._state: dict[Hashable, tuple[int, float]] = {}  # key -> (failures, retry at)

    def failed(self, key: Hashable) -> float:
        """Records a failure of ``key``; returns how long it is left alone (seconds)."""
        failures = self._state.get(key, (0, 0.0))[0] + 1
        delay = min(self._longest, self._first * 2 ** min(failures - 1, 62))
        delay *= 0.5 + 0.5 * self._rng()
        self._state[key] = (failures, self._clock() + delay)
        return delay

    def succeeded(self, key: Hashable) -> None:
        """Forgets ``key``'s failures."""
        self._state.pop(key, None)

    def due(self, key: Hashable) -> bool:
        """Whether ``key`` may be tried now."""
        state = self._state.get(key)
        return state is None or self._clock() >= state[1]

    def failures(self, key: Hashable) -> int:
        """Failures of ``key`` in a row."""
        return self._state.get(key, (0, 0.0))[0]

    def next_due_s(self) -> float | None:
        """Seconds until the first key left alone may be tried again (None: none is)."""
        if not self._state:
            return None
        return max(0.0, min(at for _, at in self._state.values()) - self._clock())
