"""Retries of object-store requests: bounded by a deadline, spaced by full-jitter backoff.

A throttling store (S3 ``503 SlowDown`` while a prefix scales, GCS ``429`` while a
bucket ramps up) answers for minutes, not seconds. Every request path of an
object-store root (TensorStore kvstore calls, direct ranged GETs, botocore's
create-only PUTs and batched deletes) therefore retries throttling and transient
failures until a deadline -- by default the manager's ``save_timeout_s`` -- rather
than a fixed count of attempts: a store that throttles for a minute slows a save
down, it does not fail it.

The delay before retry ``n`` is drawn uniformly from ``[0, min(max_s, initial_s *
2**n))`` ("full jitter"): clients throttled together spread their retries over the
whole window instead of coming back in waves, which is what AWS recommends. The
last delay is cut short at the deadline, so one more attempt runs there.

>>> b = Backoff(initial_s=0.5, max_s=8.0, deadline_s=60.0)
>>> 0.0 <= b.delay(0, started=0.0, now=1.0) <= 0.5
True
>>> b.delay(3, started=0.0, now=60.0) is None  # the deadline has passed
True
>>> Backoff(initial_s=0.5, max_s=8.0, deadline_s=60.0, max_retries=2).delay(2, 0.0, 1.0)
>>> b.tensorstore_retries()  # 0.5 + 1 + 2 + 4, then 8 s apart: 60 s after 11 retries
11
"""

from __future__ import annotations

import dataclasses
import errno
import math
import random
import time

STUCK_WRITE_S = 2.0
"""A small write (a record, a ledger object) under way this long is being retried: its
store does not answer now. A close waits no longer for one (it takes well under a second
on a store that answers; in a storm it is retried as long as the close would wait)."""

RETRY_HTTP_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
"""HTTP statuses that say "not now" rather than "no": timeouts, throttling, server errors."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Backoff:
    """When to retry a request that failed transiently, and when to give up.

    Attributes:
      initial_s: the window of the first retry's delay.
      max_s: the largest window (the exponential growth stops there).
      deadline_s: seconds from an operation's first attempt after which it is
        not retried again; None: only ``max_retries`` bounds it.
      max_retries: the most retries of one operation; None: as many as the
        deadline allows.
    """

    initial_s: float = 0.5
    max_s: float = 8.0
    deadline_s: float | None = 120.0
    max_retries: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s < math.inf:
            raise ValueError(
                f"need 0 < initial_s <= max_s < inf, got {self.initial_s}, {self.max_s}"
            )
        if self.deadline_s is not None and not 0 < self.deadline_s < math.inf:
            raise ValueError(
                f"deadline_s must be a finite number > 0 or None, got {self.deadline_s}"
            )
        if self.deadline_s is None and self.max_retries is None:
            raise ValueError("a backoff needs a deadline or a number of retries")

    def delay(
        self, retry: int, started: float, now: float | None = None, *, unreachable: bool = False
    ) -> float | None:
        """Seconds to wait before retry ``retry`` (0: the first) of an operation whose
        first attempt began at ``started`` (``time.monotonic()``); None: give up.
        ``unreachable``: the store could not be reached at all (:func:`unreachable`),
        which is retried for :data:`UNREACHABLE_S` only, whatever the deadline."""
        if self.max_retries is not None and retry >= self.max_retries:
            return None
        now = time.monotonic() if now is None else now
        deadline = self.deadline_s
        if unreachable:
            deadline = UNREACHABLE_S if deadline is None else min(deadline, UNREACHABLE_S)
        left = math.inf if deadline is None else started + deadline - now
        if left <= 0:
            return None
        window = min(self.max_s, self.initial_s * 2 ** min(retry, 62))
        return min(random.uniform(0.0, window), left)

    def tensorstore_retries(self) -> int:
        """TensorStore's ``max_retries`` for I/O that only TensorStore retries (zarr arrays).

        TensorStore's own schedule (``initial * 2**n`` plus at most
        ``min(1 s, initial)`` of jitter, capped at ``max``) cannot be full jitter;
        the count of retries whose delays add up to the deadline bounds it by
        the same deadline.
        """
        if self.max_retries is not None:
            return self.max_retries
        assert self.deadline_s is not None
        total, retries = 0.0, 0
        while total < self.deadline_s:
            total += min(self.max_s, self.initial_s * 2 ** min(retries, 62))
            retries += 1
        return retries


UNREACHABLE_S = 8.0
"""How long a store that cannot be reached at all (no such host, nothing listening,
no route) is retried: long enough for a restarting endpoint or a DNS blip, short
enough that a wrong endpoint or a machine without network fails within seconds.
Throttling and server errors are retried to the deadline instead."""

_UNREACHABLE = (
    "Could not resolve host",  # curl 6 (TensorStore), no DNS or a wrong name
    "Could not resolve proxy",  # curl 5
    "Could not connect to server",  # curl 7: refused, no route
    "Failed to connect to",
    "Could not connect to the endpoint URL",  # botocore's EndpointConnectionError
    "Connection refused",
    "Name or service not known",
    "No route to host",
    "Network is unreachable",
)


def unreachable(error: BaseException) -> bool:
    """Whether a failure says the store could not be reached at all (the request never
    got an answer, and repeating it soon will not change that)."""
    if isinstance(error, ConnectionRefusedError):
        return True
    text = "".join([str(error), *getattr(error, "__notes__", ())])
    return any(marker in text for marker in _UNREACHABLE)


def no_space(error: BaseException | None) -> bool:
    """Whether ``error`` (or one it was raised from) is a full disk or quota: no retry helps
    until something is deleted."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        error = error.__cause__ or error.__context__
    return False


def tensorstore_transient(error: BaseException) -> bool:
    """Whether a TensorStore failure is worth retrying: a timeout, or what TensorStore
    itself retries (throttling, 5xx, dropped connections), which it marks with
    "retry attempts failed" once its own retries are spent."""
    if isinstance(error, TimeoutError):
        return True
    text = str(error)
    return "retry attempts failed" in text or text.startswith(("UNAVAILABLE", "DEADLINE_EXCEEDED"))


def elapsed_note(attempts: int, started: float) -> str:
    """`` (N attempts in S s)``: how long an operation kept trying, for its error."""
    return f" ({attempts} attempts in {time.monotonic() - started:.1f} s)"
