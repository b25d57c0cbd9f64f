"""Aligned read buffers, and reading a file into one."""

from __future__ import annotations

import mmap
import os

import numpy as np

MAPPED_BYTES = 1 << 20
"""Buffers at least this large are anonymous memory maps of their own."""


def aligned_empty(size: int, alignment: int = 64) -> np.ndarray:
    """An uninitialised uint8 numpy buffer whose data starts on ``alignment`` bytes.

    A buffer of :data:`MAPPED_BYTES` or more is a private anonymous memory map
    of its own (page-aligned, so ``jax.device_put`` can alias it): its pages
    go back to the kernel as soon as the array is dropped, and restored arrays
    never share heap pages with transient response buffers, which malloc then
    reuses for the next response. (2 MiB pages, ``MADV_HUGEPAGE``, made the
    benchmark's restores bimodal on its VM, 0.22-0.65 s against a steady
    0.28-0.32 s: a huge page's first touch can be slow on a host that backs
    guest memory lazily.)

    >>> buffer = aligned_empty(100)
    >>> buffer.nbytes, buffer.ctypes.data % 64
    (100, 0)
    """
    if size >= MAPPED_BYTES and alignment <= mmap.PAGESIZE:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        return np.frombuffer(mmap.mmap(-1, size, flags=flags), np.uint8)
    raw = np.empty(size + alignment, np.uint8)
    offset = -raw.ctypes.data % alignment
    return raw[offset : offset + size]


def pread_into(fd: int, buffer: np.ndarray, offset: int) -> int:
    """Fills ``buffer`` from byte ``offset`` of ``fd``; the bytes read (fewer at end of file)."""
    view = buffer.data
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if not n:
            break
        done += n
    return done
