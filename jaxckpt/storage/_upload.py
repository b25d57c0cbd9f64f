"""Local files uploaded to object stores in bounded parts, never read whole into memory.

:func:`upload_file` puts a local file under a key of any :class:`Storage`: a file no
larger than ``part_bytes`` in one :meth:`Storage.write`; a larger one through the
root's :class:`FileUploads` capability, which streams it from the file part by part
(S3: a multipart upload, :mod:`jaxckpt.storage._s3upload`; GCS: a resumable upload,
:mod:`jaxckpt.storage._gcsupload`). Each part's body is a :class:`FileSlice`, a
seekable window of the file read with ``pread`` as the HTTP client sends it, so
memory stays at the client's send buffer whatever the part size.

>>> import os, tempfile
>>> path = os.path.join(tempfile.mkdtemp(), "f")
>>> with open(path, "wb") as f:
...     _ = f.write(b"0123456789")
>>> with FileSlice.open(path, 2, 5) as part:
...     part.read(3), part.read(), part.seek(0), part.read(1)
(b'234', b'56', 0, b'2')
>>> s3_part_bytes(100 << 20, budget=1 << 20) == S3_MIN_PART
True
"""

from __future__ import annotations

import errno
import hashlib
import io
import math
import os
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from jaxckpt.errors import StorageError
from jaxckpt.storage._base import Storage

__all__ = ["FileSlice", "FileUploads", "s3_part_bytes", "upload_file"]

S3_MIN_PART = 5 << 20
"""S3's smallest part (every part but the last)."""
S3_MAX_PART = 5 << 30
"""S3's largest part."""
S3_MAX_PARTS = 10_000
"""S3's most parts in one multipart upload."""
GCS_CHUNK_UNIT = 256 << 10
"""GCS takes resumable-upload chunks in multiples of 256 KiB (but the last)."""
_READ = 1 << 20

Progress = Callable[[int], None]
"""Told the bytes of each part once it is stored (may raise to stop the upload)."""


@runtime_checkable
class FileUploads(Protocol):
    """A root that can store a local file under a key in parts (S3, GCS)."""

    def upload_file(
        self, key: str, path: str, *, part_bytes: int, progress: Progress | None = None
    ) -> int:
        """Stores the file at ``path`` as ``key``, streamed in parts of about
        ``part_bytes`` (bounded by the store's limits); returns the number of parts.

        Raises:
          StorageError: the store failed (naming the object), or this root cannot
            upload in parts (a client library is missing).
        """
        ...


class FileSlice(io.RawIOBase):
    """``size`` bytes of an open file from ``offset``: a seekable, read-only request body
    (read with ``pread``, so slices of one file may be read by several threads)."""

    def __init__(self, fd: int, offset: int, size: int, *, owns: bool = False) -> None:
        super().__init__()
        self._fd, self._offset, self._size, self._owns = fd, offset, size, owns
        self._at = 0

    @classmethod
    def open(cls, path: str, offset: int, size: int) -> FileSlice:
        return cls(os.open(path, os.O_RDONLY), offset, size, owns=True)

    def __len__(self) -> int:
        return self._size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._size}[whence]
        self._at = max(0, base + offset)
        return self._at

    def readinto(self, buffer: memoryview | bytearray) -> int:  # type: ignore[override]
        want = min(len(buffer), self._size - self._at)
        if want <= 0:
            return 0
        data = os.pread(self._fd, want, self._offset + self._at)
        if not data:
            raise StorageError(errno.EIO, f"the file ended {self._size - self._at} bytes early")
        memoryview(buffer)[: len(data)] = data
        self._at += len(data)
        return len(data)

    def read(self, size: int | None = -1) -> bytes:
        left = self._size - self._at
        size = left if size is None or size < 0 else min(size, left)
        if size <= 0:
            return b""
        data = os.pread(self._fd, size, self._offset + self._at)  # one buffer, no copy
        if not data:
            raise StorageError(errno.EIO, f"the file ended {left} bytes early")
        self._at += len(data)
        return data

    def digest(self, algorithm: str = "md5") -> bytes:
        """The slice's digest, read through once (from the page cache, in 1 MiB reads)."""
        h = hashlib.new(algorithm, usedforsecurity=False)
        for at in range(0, self._size, _READ):
            h.update(os.pread(self._fd, min(_READ, self._size - at), self._offset + at))
        return h.digest()

    def close(self) -> None:
        if self._owns and not self.closed:
            os.close(self._fd)
        super().close()


def s3_part_bytes(size: int, budget: int) -> int:
    """The part size of a multipart upload of ``size`` bytes: ``budget``, raised to
    S3's minimum part and to what keeps the parts within 10,000, at most 5 GiB."""
    return min(S3_MAX_PART, max(budget, S3_MIN_PART, math.ceil(size / S3_MAX_PARTS)))


def gcs_chunk_bytes(budget: int) -> int:
    """The chunk size of a resumable upload: ``budget`` rounded down to 256 KiB (one at least)."""
    return max(GCS_CHUNK_UNIT, budget // GCS_CHUNK_UNIT * GCS_CHUNK_UNIT)


def upload_file(
    storage: Storage, key: str, path: str, *, part_bytes: int, progress: Progress | None = None
) -> int:
    """Stores the local file ``path`` as ``key`` of ``storage``, never holding more than
    ``part_bytes`` of it in memory: one write when it fits, else the root's
    :class:`FileUploads` in parts. Returns the number of requests that carried data.

    Raises:
      StorageError: the store failed, or the file is larger than ``part_bytes`` and the
        root cannot upload in parts (``EOPNOTSUPP``, naming it).
      OSError: the file cannot be read.
    """
    size = os.path.getsize(path)
    if size > part_bytes and isinstance(storage, FileUploads):
        return storage.upload_file(key, path, part_bytes=part_bytes, progress=progress)
    if size > part_bytes:
        raise StorageError(
            errno.EOPNOTSUPP,
            f"cannot upload {path} ({size} bytes) to {storage.uri}/{key}: it is larger than "
            f"the memory budget ({part_bytes} bytes) and this root takes whole objects only",
        )
    with open(path, "rb") as f:
        storage.write(key, f.read())
    if progress is not None:
        progress(size)
    return 1
