"""``map`` over a thread pool with a bounded number of tasks queued.

``Executor.map`` submits every item at once. The count of records a step's
reader fetches comes from storage (a marker's ``num_processes``, up to
``MAX_PROCESSES``): queued all at once, a marker claiming a million parts
held a million tasks before the first missing one was noticed. Here at most
``window`` tasks are queued or running, results come back in order, and the
first failure (in order) stops further submissions.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future
from typing import TypeVar

__all__ = ["windowed_map"]

_T = TypeVar("_T")
_R = TypeVar("_R")


def windowed_map(
    pool: Executor, fn: Callable[[_T], _R], items: Iterable[_T], window: int
) -> list[_R]:
    """``[fn(i) for i in items]`` on ``pool``, at most ``window`` tasks in flight.

    >>> from concurrent.futures import ThreadPoolExecutor
    >>> with ThreadPoolExecutor(2) as pool:
    ...     windowed_map(pool, lambda x: x * x, range(5), window=2)
    [0, 1, 4, 9, 16]

    Raises:
      Exception: the first item's failure, in order; items after it that were not
        yet started are cancelled and later ones never submitted.
    """
    if window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    out: list[_R] = []
    flight: deque[Future[_R]] = deque()
    try:
        for item in items:
            if len(flight) >= window:
                out.append(flight.popleft().result())
            flight.append(pool.submit(fn, item))
        while flight:
            out.append(flight.popleft().result())
    finally:
        for future in flight:
            future.cancel()
    return out
