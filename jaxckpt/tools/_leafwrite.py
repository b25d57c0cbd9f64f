"""Writing one leaf of a committed step into a file under a memory budget.

:func:`write_leaf` streams a :class:`~jaxckpt.restoring.LeafView`'s C-order bytes into a
file at an offset: in contiguous blocks of whole chunk rows when one row fits the block
budget, else chunk by chunk, each chunk's innermost rows written at their offsets in the
file (``os.pwrite``), so a leaf larger than the budget never sits in memory whole. A chunk
is the smallest unit read (its checksum covers it whole). The safetensors export
(:mod:`jaxckpt.tools._safetensors`) and published weights write through it.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator, Sequence
from itertools import product

import numpy as np

from jaxckpt.restoring import LeafView


def _le_bytes(block: np.ndarray) -> np.ndarray:
    """The block's little-endian C-order bytes as a uint8 array (no copy when possible)."""
    if block.dtype.byteorder == ">":
        block = block.astype(block.dtype.newbyteorder("<"))
    return np.ascontiguousarray(block).reshape(-1).view(np.uint8)


def pwrite_all(fd: int, data: memoryview | bytes, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _chunk_regions(view: LeafView) -> Iterator[tuple[tuple[int, int], ...]]:
    """The leaf's chunks, one region each, in row-major order of the chunk grid."""
    shape, chunk = view.shape, view.leaf.chunk_shape
    starts = [range(0, d, c) for d, c in zip(shape, chunk, strict=True)]
    for lo in product(*starts):
        yield tuple((a, min(a + c, d)) for a, c, d in zip(lo, chunk, shape, strict=True))


def _row_bytes(view: LeafView) -> int:
    """The bytes of one row of chunks (what :meth:`LeafView.blocks` reads at least)."""
    shape = view.shape
    if not shape or view.size == 0:
        return view.nbytes
    unit = view.leaf.chunk_shape[0] if view.leaf.chunk_shape else 1
    return view.nbytes // shape[0] * min(unit, shape[0])


def chunk_bytes(view: LeafView) -> int:
    """The bytes of one (full) chunk of the leaf: the least a read of it holds."""
    chunk = view.leaf.chunk_shape or view.shape
    return math.prod(min(c, d) for c, d in zip(chunk, view.shape, strict=True)) * (
        view.dtype.itemsize
    )


def write_leaf(
    fd: int, base: int, view: LeafView, block_bytes: int, progress: Callable[[int], None] | None
) -> int:
    """Writes the leaf's little-endian C-order bytes into ``fd`` from offset ``base``,
    holding one block of at most ``block_bytes`` (and the chunks read into it) at once;
    returns the bytes written. ``progress`` is told the bytes of each block or chunk."""
    written = 0
    if not view.shape or _row_bytes(view) <= block_bytes:  # contiguous blocks of whole rows
        for region in view.block_regions(block_bytes):
            data = _le_bytes(view.read_region(region))
            pwrite_all(fd, data.data, base + written)
            written += data.nbytes
            if progress is not None:
                progress(data.nbytes)
            del data  # before the next block is read
        return written
    shape, itemsize = view.shape, view.dtype.itemsize
    for region in _chunk_regions(view):  # chunk by chunk: each row of a chunk at its offset
        block = view.read_region(region)
        for inner in product(*(range(hi - lo) for lo, hi in region[:-1])):
            at = [lo + i for (lo, _), i in zip(region[:-1], inner, strict=True)]
            flat = int(np.ravel_multi_index((*at, region[-1][0]), shape))
            data = _le_bytes(block[inner])
            pwrite_all(fd, data.data, base + flat * itemsize)
            written += data.nbytes
            del data  # a view of the block
        if progress is not None:
            progress(block.nbytes)
        del block  # before the next chunk is read
    return written


def write_file(
    path: str,
    header: bytes,
    leaves: Sequence[tuple[str, LeafView]],
    block_bytes: int,
    progress: Callable[[int], None] | None,
) -> None:
    """Writes ``header`` and then each named leaf's bytes, back to back, into a new file
    ``path`` (made durable before it returns)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        pwrite_all(fd, header, 0)
        base = len(header)
        for name, view in leaves:
            written = write_leaf(fd, base, view, block_bytes, progress)
            if written != view.nbytes:  # a bug, never bad data: every chunk was checked
                raise AssertionError(f"{name}: wrote {written} of {view.nbytes} bytes")
            base += view.nbytes
        os.fsync(fd)
    finally:
        os.close(fd)


def leaf_block_bytes(max_memory_bytes: int) -> int:
    """The block a budget allows: a third of it. A block being read holds its chunks'
    bytes as read and the block they are copied into (two blocks), with room to spare."""
    return max_memory_bytes // 3


def budget_problem(views: Sequence[LeafView], max_memory_bytes: int) -> str | None:
    """Why ``max_memory_bytes`` cannot stream a leaf (a block below one of its chunks:
    the budget below three chunks), or None."""
    for view in views:
        if chunk_bytes(view) > leaf_block_bytes(max_memory_bytes):
            return (
                f"max_memory_bytes={max_memory_bytes} is below three chunks of {view.path} "
                f"({chunk_bytes(view)} bytes each, shape {list(view.leaf.chunk_shape)}): "
                "raise the budget, or save with a smaller chunk_bytes"
            )
    return None


def fsync_dir(path: str) -> None:
    """Makes the names in directory ``path`` durable (where the file system can)."""
    with contextlib.suppress(OSError):  # not every file system syncs directories
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
