"""Object reads into aligned buffers: parallel ranged GETs under one memory budget.

TensorStore hands a kvstore read to Python as one ``bytes`` object, which is
neither writable nor 64-byte aligned, so ``jax.device_put(..., may_alias=True)``
must copy it: holding those objects until every leaf is read doubled restore
memory on object stores. Here a chunk object whose size is known (from the
manifest) is read as ranged GETs of ``part_bytes`` into a buffer from
:func:`aligned_empty` that becomes the array; each part's ``bytes`` is dropped
as soon as it is copied, and at most ``ahead_bytes`` of parts are in flight
for one storage object (all reader threads together), which bounds the
transient memory. A large object is fetched by several requests at once.

glibc's malloc raises its mmap threshold to the size of the largest block
freed so far (up to 32 MiB) and then keeps freed blocks of that size in its
per-thread arenas, where :func:`malloc_trim` cannot reach the top of a heap:
the parts' ``bytes`` (allocated on reader threads) stayed resident after they
were freed, 0.3-0.4x the state on the issue-14 benchmark. The first reader in
a process therefore pins glibc's mmap and trim thresholds
(:func:`release_large_frees`), so that a freed part goes back to the kernel.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import math
import os
import threading
from collections import deque
from collections.abc import Callable

import numpy as np
import tensorstore as ts

from jaxckpt._storage import aligned_empty
from jaxckpt.errors import StorageError

# TensorStore's answer when an object is shorter than the requested range
# (S3: OUT_OF_RANGE; the GCS emulator: an unexpected Content-Range).
_SHORT_MARKERS = ("OUT_OF_RANGE", "Unexpected Content-Range")


MALLOC_TUNING_ENV = "JAXCKPT_MALLOC_TUNING"
"""Set to ``0`` to leave glibc's malloc thresholds alone (see :func:`release_large_frees`)."""
# mallopt(3) parameters.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
LARGE_FREE_BYTES = 1 << 20
"""Blocks at least this large are mmap-ed and returned to the kernel when freed."""


@functools.cache
def release_large_frees() -> bool:
    """Pins glibc's malloc thresholds at :data:`LARGE_FREE_BYTES` (once per process).

    A process-wide setting: blocks of 1 MiB and more are then always mapped
    and unmapped (glibc's own behaviour until the first such block is freed,
    128 KiB by default), and a heap shrinks once 1 MiB at its top is free.
    Returns False where the C library is not glibc, or where the environment
    sets ``JAXCKPT_MALLOC_TUNING=0`` (nothing is changed: an application that
    tunes malloc itself keeps its settings, and restores keep freed response
    buffers resident as glibc decides).
    """
    if os.environ.get(MALLOC_TUNING_ENV, "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols, the C library's among them
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 -- glibc only
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(
        mallopt(_M_MMAP_THRESHOLD, LARGE_FREE_BYTES)
        and mallopt(_M_TRIM_THRESHOLD, LARGE_FREE_BYTES)
    )


class ShortObjectError(Exception):
    """The object is shorter than the size it was read with (the caller reads it whole)."""


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


class RangedReader:
    """Reads objects of known size into aligned buffers, parts in parallel.

    Args:
      kv: the bucket's kvstore.
      part_bytes: the largest ranged GET.
      ahead_bytes: the transient memory of every thread using this reader
        together: the parts in flight plus the Python copy each becomes before
        it lands in its buffer, so ``ahead_bytes // (2 * part_bytes)`` parts
        are in flight (at least one).
      timeout_s: the longest wait for one part, or for room in the budget.
      error: turns a TensorStore failure into a :class:`StorageError`.
    """

    def __init__(
        self,
        kv: ts.KvStore,
        *,
        part_bytes: int,
        ahead_bytes: int,
        timeout_s: float | None,
        error: Callable[[str, str, BaseException], StorageError],
    ) -> None:
        self._kv = kv
        self._part = part_bytes
        self._slots = threading.Semaphore(max(1, ahead_bytes // (2 * part_bytes)))
        self.ahead_bytes = ahead_bytes
        self._timeout = timeout_s
        self._error = error
        self._count_lock = threading.Lock()
        self._inflight = 0
        self.peak_inflight_bytes = 0
        """The most response bytes requested and not yet placed, at any moment."""
        release_large_frees()

    def set_budget(self, *, part_bytes: int, ahead_bytes: int) -> bool:
        """Changes the budget between restores; False (unchanged) while reads are in flight.

        A read racing the change may return its slot to the new budget: one
        part over it at most, never a deadlock.
        """
        with self._count_lock:
            if self._inflight:
                return False
            self._part = part_bytes
            self._slots = threading.Semaphore(max(1, ahead_bytes // (2 * part_bytes)))
            self.ahead_bytes = ahead_bytes
            return True

    def _count(self, nbytes: int) -> None:
        with self._count_lock:
            self._inflight += nbytes
            self.peak_inflight_bytes = max(self.peak_inflight_bytes, self._inflight)

    def read(self, name: str, size: int, offset: int = 0) -> np.ndarray | None:
        """``size`` bytes of object ``name`` from byte ``offset``; None if it does not exist.

        Raises:
          ShortObjectError: the object is shorter than ``offset + size``.
          StorageError: the store failed, or no part arrived within the timeout.
        """
        buffer = aligned_empty(size)
        pending: deque[tuple[int, int, ts.Future[ts.KvStore.ReadResult]]] = deque()
        try:
            for lo, hi in part_ranges(size, self._part):
                if not self._acquire(name, pending, buffer):
                    return None
                self._count(hi - lo)
                future = self._kv.read(name, byte_range=slice(offset + lo, offset + hi))
                pending.append((lo, hi, future))
            while pending:
                if not self._place(name, pending.popleft(), buffer):
                    return None
        finally:
            for lo, hi, future in pending:
                future.cancel()
                self._count(lo - hi)
                self._slots.release()
        return buffer

    def _acquire(self, name: str, pending: deque, buffer: np.ndarray) -> bool:
        """Takes a slot; while none is free, finishes this thread's own oldest part.

        Returns False if a finished part says the object is missing.

        A thread never waits for a slot while it holds one, so threads sharing
        the budget cannot deadlock.
        """
        while not self._slots.acquire(blocking=False):
            if not pending:
                if not self._slots.acquire(timeout=self._timeout):
                    raise self._error("read", name, TimeoutError())
                return True
            if not self._place(name, pending.popleft(), buffer):
                return False
        return True

    def _place(self, name: str, item: tuple, buffer: np.ndarray) -> bool:
        """Copies one finished part into ``buffer`` and frees its slot; False if missing."""
        lo, hi, future = item
        try:
            try:
                result = future.result(timeout=self._timeout)
            except TimeoutError as e:
                future.cancel()
                raise self._error("read", name, e) from e
            except (ValueError, NotImplementedError) as e:
                if any(m in str(e) for m in _SHORT_MARKERS):
                    raise ShortObjectError(name) from e
                raise self._error("read", name, e) from e
            if result.state != "value":
                return False
            value = result.value
            if len(value) != hi - lo:
                raise ShortObjectError(name)
            buffer[lo:hi] = np.frombuffer(value, np.uint8)
            return True
        finally:
            self._count(lo - hi)
            self._slots.release()
