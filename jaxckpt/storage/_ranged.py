"""Object reads into aligned buffers: parallel ranged GETs under one memory budget.

TensorStore hands a kvstore read to Python as one ``bytes`` object, which is
neither writable nor 64-byte aligned, so ``jax.device_put(..., may_alias=True)``
must copy it: holding those objects until every leaf is read doubled restore
memory on object stores. Here a chunk object whose size is known (from the
manifest) is read as ranged GETs of ``part_bytes`` into a buffer from
:func:`aligned_empty` that becomes the array; each part's ``bytes`` is dropped
as soon as it is copied, and the responses in flight for one storage object
(all reader threads together) are bounded by ``ahead_bytes``, less room for
the copies, which bounds the transient memory. A large object is fetched by
several requests at once.

Every part is turned into ``bytes`` and copied by the process's one placer
thread, whichever thread asked for it. glibc's malloc serves each thread from
its own arena and keeps the blocks freed there for that arena's next
allocations: with the parts placed by eight reader threads, eight arenas each
kept a few parts' worth resident (0.3x the state on the issue-14 benchmark),
and returning them to the kernel instead (``mallopt``) cost a page fault per
4 KiB on every part, which made restores 1.5-2x slower. One placer thread
reuses one arena's few blocks for every part.

With a :class:`~jaxckpt.storage._http.DirectReader` (the default on S3 and GCS),
parts are instead read by its own HTTP connections straight into the buffer
(no response copy, so no budget: parts of ``direct_part_bytes``, the first on
the calling thread, the others on the process's GET threads). A part that
fails there is read again through TensorStore as above; one that the store
throttled until the retry deadline fails the read.

A part whose TensorStore read fails transiently (throttling, 5xx, a dropped
connection) is read again on the calling thread, with the root's backoff
(``call``), outside the budget: at most one such part per reading thread.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np
import tensorstore as ts

from jaxckpt import _pools as pools
from jaxckpt.errors import StorageError
from jaxckpt.storage._buffers import aligned_empty
from jaxckpt.storage._http import DirectReader, DirectReadError, StoreUnavailableError
from jaxckpt.storage._retry import tensorstore_transient

_log = logging.getLogger(__name__)

# TensorStore's answer when an object is shorter than the requested range
# (S3: OUT_OF_RANGE; the GCS emulator: an unexpected Content-Range).
_SHORT_MARKERS = ("OUT_OF_RANGE", "Unexpected Content-Range")


class ShortObjectError(Exception):
    """The object is shorter than the size it was read with (the caller reads it whole)."""


class _Again(Exception):
    """A part's read failed transiently: the reading thread reads it again (with backoff)."""


Call = Callable[[str, str, Callable[[], Any]], Any]
"""``call(action, name, start)``: the result of the request ``start`` sends, retried with
backoff while it fails transiently (``ObjectRequests._call``)."""


def part_ranges(size: int, part_bytes: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` ranges of about equal size, each at most ``part_bytes``.

    An overshoot of at most 1/64 of a part (a chunk's 4-byte CRC trailer)
    is spread over the parts rather than fetched by a request of its own.

    >>> part_ranges(10, 4)
    [(0, 3), (3, 6), (6, 10)]
    >>> part_ranges(8 + 4, 4 << 20)[-1]
    (0, 12)
    >>> len(part_ranges((16 << 20) + 4, 4 << 20))
    4
    >>> part_ranges(0, 4)
    []
    """
    if size <= 0:
        return []
    n = max(1, math.ceil((size - part_bytes // 64) / part_bytes))
    bounds = [size * i // n for i in range(n + 1)]
    return list(itertools.pairwise(bounds))


GET_THREADS = 16
"""Threads per process for the second and later parts of direct reads."""


def _placer() -> ThreadPoolExecutor:
    """The process's one placer thread."""
    return pools.pool("place", 1)


def _getters() -> ThreadPoolExecutor:
    """The process's threads for direct-read parts."""
    return pools.pool("get", GET_THREADS)


PLACEMENT_PARTS = 3
"""Parts of the budget not in flight: the Python copy being placed, and what malloc keeps."""


class _Budget:
    """Bytes of responses in flight, at most ``capacity`` (one request alone may exceed it)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._used = 0
        self.peak = 0
        """The most bytes in flight at any moment."""
        self._changed = threading.Condition()

    @property
    def used(self) -> int:
        return self._used

    def acquire(self, nbytes: int, timeout: float | None) -> bool:
        """Takes ``nbytes``; False if there was no room within ``timeout``."""
        with self._changed:
            if not self._changed.wait_for(
                lambda: self._used == 0 or self._used + nbytes <= self.capacity, timeout
            ):
                return False
            self._used += nbytes
            self.peak = max(self.peak, self._used)
            return True

    def release(self, nbytes: int) -> None:
        with self._changed:
            self._used -= nbytes
            self._changed.notify_all()


def _budget(part_bytes: int, ahead_bytes: int) -> _Budget:
    """The budget less :data:`PLACEMENT_PARTS` parts (at least one part)."""
    return _Budget(max(part_bytes, ahead_bytes - PLACEMENT_PARTS * part_bytes))


class RangedReader:
    """Reads objects of known size into aligned buffers, parts in parallel.

    Args:
      kv: the bucket's kvstore.
      part_bytes: the largest ranged GET.
      ahead_bytes: the transient memory of every thread using this reader
        together: the parts in flight, the Python copy of the one being
        placed, and what malloc keeps of the parts it freed (measured: one to
        two parts), so ``ahead_bytes - 3 * part_bytes`` of responses are in
        flight (at least one part; small objects count their own size).
      timeout_s: the longest wait for one part, or for room in the budget.
      error: turns a TensorStore failure into a :class:`StorageError`.
      call: sends a request and retries it while it fails transiently; None:
        one attempt.
      direct: reads parts over its own connections into the buffer (while
        it is enabled); TensorStore reads what fails there.
      direct_part_bytes: the largest part of a direct read (the first part
        is read on the calling thread, the others on the process's
        :data:`GET_THREADS` threads).
    """

    def __init__(
        self,
        kv: ts.KvStore,
        *,
        part_bytes: int,
        ahead_bytes: int,
        timeout_s: float | None,
        error: Callable[[str, str, BaseException], StorageError],
        call: Call | None = None,
        direct: DirectReader | None = None,
        direct_part_bytes: int = 64 << 20,
    ) -> None:
        self._kv = kv
        self.direct = direct
        self._direct_part = direct_part_bytes
        self._part = part_bytes
        self._budget = _budget(part_bytes, ahead_bytes)
        self.ahead_bytes = ahead_bytes
        self._timeout = timeout_s
        self._error = error
        self._call = call
        self._earlier_peak = 0  # of the budgets set_budget replaced

    @property
    def peak_inflight_bytes(self) -> int:
        """The most response bytes requested and not yet placed, at any moment."""
        return max(self._earlier_peak, self._budget.peak)

    def set_budget(self, *, part_bytes: int, ahead_bytes: int) -> bool:
        """Changes the budget between restores; False (unchanged) while reads are in flight.

        Every part returns its bytes to the budget it took them from.
        """
        if self._budget.used:
            return False
        self._earlier_peak = self.peak_inflight_bytes
        self._part = part_bytes
        self._budget = _budget(part_bytes, ahead_bytes)
        self.ahead_bytes = ahead_bytes
        return True

    def read(self, name: str, size: int, offset: int = 0) -> np.ndarray | None:
        """``size`` bytes of object ``name`` from byte ``offset``; None if it does not exist.

        Raises:
          ShortObjectError: the object is shorter than ``offset + size``.
          StorageError: the store failed, or no part arrived within the timeout.
        """
        if self.direct is not None and self.direct.enabled:
            return self._read_direct(self.direct, name, size, offset)
        buffer = aligned_empty(size)
        # Held until placed or cancelled: a finished request holds its response.
        requests: dict[int, ts.Future[ts.KvStore.ReadResult]] = {}
        placed: list[Future[bool]] = []
        try:
            for lo, hi in part_ranges(size, self._part):
                budget = self._budget
                if not budget.acquire(hi - lo, self._timeout):
                    raise self._error("read", name, TimeoutError())
                try:
                    requests[lo] = self._kv.read(name, byte_range=slice(offset + lo, offset + hi))
                except BaseException:
                    budget.release(hi - lo)
                    raise
                placed.append(self._when_done(requests, name, buffer, lo, hi, budget))
            again = self._read_again(name, buffer, offset)
            return buffer if self._all_found(name, placed, True, again) else None
        finally:
            for request in list(requests.values()):
                request.cancel()  # returns the budget of a part still in flight

    def _read_direct(
        self, direct: DirectReader, name: str, size: int, offset: int
    ) -> np.ndarray | None:
        """:meth:`read` over ``direct``'s connections, parts in parallel, into the buffer."""
        buffer = aligned_empty(size)
        first, *rest = part_ranges(size, self._direct_part)
        others = [
            _getters().submit(self._direct_part_into, direct, name, buffer, offset, lo, hi)
            for lo, hi in rest
        ]
        found = self._direct_part_into(direct, name, buffer, offset, *first)
        return buffer if self._all_found(name, others, found) else None

    def _all_found(
        self,
        name: str,
        parts: list[Future[bool]],
        found: bool,
        again: Callable[[int, int], bool] | None = None,
    ) -> bool:
        """Waits for every part (each within the timeout); whether all found the object.

        A part that failed transiently (``_Again``) is read again by ``again(lo, hi)``.
        """
        for part in parts:
            try:
                found = part.result(timeout=self._timeout) and found
            except FutureTimeout as e:
                raise self._error("read", name, TimeoutError()) from e
            except _Again as e:
                if again is None:
                    raise self._error("read", name, e.__cause__ or e) from e
                lo, hi = e.args
                found = again(lo, hi) and found
        return found

    def _read_again(self, name: str, buffer: np.ndarray, offset: int) -> Callable[[int, int], bool]:
        """Reads part ``[lo, hi)`` through TensorStore with backoff, into ``buffer``."""

        def again(lo: int, hi: int) -> bool:
            def start() -> Any:
                return self._kv.read(name, byte_range=slice(offset + lo, offset + hi))

            if self._call is None:
                return self._place(start(), name, buffer, lo, hi, timeout=self._timeout)
            try:
                result = self._call("read", name, start)
            except StorageError as e:
                if any(m in str(e) for m in _SHORT_MARKERS):
                    raise ShortObjectError(name) from e
                raise
            return self._put(result, name, buffer, lo, hi)

        return again

    def _direct_part_into(
        self, direct: DirectReader, name: str, buffer: np.ndarray, offset: int, lo: int, hi: int
    ) -> bool:
        """Reads ``[lo, hi)`` into ``buffer`` directly, else through TensorStore."""
        try:
            got = direct.read_into(name, offset + lo, buffer[lo:hi].data)
        except StoreUnavailableError as e:
            raise self._error("read", name, e) from e
        except DirectReadError as e:
            _log.debug(
                "direct read of %s [%d, %d) failed (%s); reading it through TensorStore",
                name,
                offset + lo,
                offset + hi,
                e,
            )
            return self._read_again(name, buffer, offset)(lo, hi)
        if got is None:
            return False
        if got < hi - lo:
            raise ShortObjectError(name)
        return True

    def _when_done(
        self,
        requests: dict[int, ts.Future[ts.KvStore.ReadResult]],
        name: str,
        buffer: np.ndarray,
        lo: int,
        hi: int,
        budget: _Budget,
    ) -> Future[bool]:
        """Part ``lo``'s placement, queued on the placer thread once its response is in."""
        placed: Future[bool] = Future()

        def place() -> None:
            try:
                placed.set_result(self._place(requests[lo], name, buffer, lo, hi))
            except BaseException as e:  # the reading thread raises it
                placed.set_exception(e)
            finally:
                requests.pop(lo, None)  # the response's memory goes with the request
                budget.release(hi - lo)

        def queue(_: ts.Future[ts.KvStore.ReadResult]) -> None:
            _placer().submit(place)

        requests[lo].add_done_callback(queue)
        return placed

    def _place(
        self,
        request: ts.Future[ts.KvStore.ReadResult],
        name: str,
        buffer: np.ndarray,
        lo: int,
        hi: int,
        timeout: float | None = 0,
    ) -> bool:
        """Copies one part into ``buffer`` once it is in (within ``timeout``); False if missing."""
        try:
            result = request.result(timeout=timeout)
        except TimeoutError as e:
            request.cancel()
            raise self._error("read", name, e) from e
        except (ValueError, NotImplementedError) as e:
            if any(m in str(e) for m in _SHORT_MARKERS):
                raise ShortObjectError(name) from e
            if self._call is not None and tensorstore_transient(e):
                raise _Again(lo, hi) from e
            raise self._error("read", name, e) from e
        return self._put(result, name, buffer, lo, hi)

    @staticmethod
    def _put(
        result: ts.KvStore.ReadResult, name: str, buffer: np.ndarray, lo: int, hi: int
    ) -> bool:
        """Copies a part's response into ``buffer``; False if the object is missing."""
        if result.state != "value":
            return False
        value = result.value
        if len(value) != hi - lo:
            raise ShortObjectError(name)
        buffer[lo:hi] = np.frombuffer(value, np.uint8)
        return True
