"""Roots on a POSIX file system (local disk, NFS, Lustre)."""

from __future__ import annotations

import errno
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from jaxckpt.errors import StorageError
from jaxckpt.storage._base import PreconditionFailed
from jaxckpt.storage._buffers import aligned_empty, pread_into
from jaxckpt.storage._durable import fsync_dir as _fsync_dir
from jaxckpt.storage._durable import makedirs_durable as _makedirs_durable

_RMTREE_ATTEMPTS = 8  # a zombie writer may create files while its attempt is removed
_RMTREE_RACES = 10_000  # walks restarted because another remover took an entry first
_RMTREE_DEADLINE_S = 30.0  # a writer that refills faster than the walks remove is left for later
_CLOCK_PROBE = ".jaxckpt-clock-"  # created and removed at once by age()


def _join(root: str, key: str) -> str:
    return os.path.join(root, *key.split("/"))


class LocalStorage:
    """A root on a POSIX file system (local disk, NFS, Lustre).

    Every write is fsync'd together with its directory, so a key that
    :meth:`write` returned for survives a power cut. Create-only writes use
    ``O_CREAT | O_EXCL``.
    """

    def __init__(self, path: str, *, io_concurrency: int = 32) -> None:
        self._root = os.path.abspath(path)
        self._io_concurrency = io_concurrency

    @property
    def uri(self) -> str:
        return self._root

    def __repr__(self) -> str:
        return f"LocalStorage({self._root!r})"

    def free_bytes(self) -> int:
        """The bytes free for this root on its file system (``statvfs``; a full disk
        makes retention keep fewer local steps until there is room again)."""
        return shutil.disk_usage(self._root).free

    def _error(self, action: str, key: str, exc: OSError) -> StorageError:
        detail = exc.strerror or str(exc)
        if exc.errno == errno.ENOSPC:
            detail = "no space left on device"
        return StorageError(exc.errno or 0, f"cannot {action} {_join(self._root, key)}: {detail}")

    def read(self, key: str) -> bytes | None:
        try:
            with open(_join(self._root, key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise self._error("read", key, e) from e

    def read_buffer(self, key: str, size: int | None = None) -> bytes | np.ndarray | None:
        del size  # the file's own size is read; a mismatch is the caller's to report
        try:
            with open(_join(self._root, key), "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                buffer = aligned_empty(size)
                done = pread_into(f.fileno(), buffer, 0)
                if done < size:
                    raise OSError(errno.EIO, f"file shrank while reading ({done} of {size})")
                return buffer
        except FileNotFoundError:
            return None
        except OSError as e:
            raise self._error("read", key, e) from e

    def read_range(self, key: str, offset: int, size: int) -> bytes | np.ndarray | None:
        try:
            with open(_join(self._root, key), "rb", buffering=0) as f:
                buffer = aligned_empty(size)
                done = pread_into(f.fileno(), buffer, offset)
                return buffer[:done]  # short if the object ends early: the caller's size check
        except FileNotFoundError:
            return None
        except OSError as e:
            raise self._error("read", key, e) from e

    def write(
        self, key: str, data: bytes | Sequence[bytes | memoryview], *, exclusive: bool = False
    ) -> None:
        """Writes and fsyncs ``key`` (``data``, or its pieces in order, written by ``writev``
        without joining them); with ``exclusive``, atomically and create-only.

        A create-only write goes to a hidden temporary file in the same
        directory first and is then hard-linked to ``key`` (``link`` fails if
        ``key`` exists, atomically, also on NFS), so a crash never leaves a
        torn record under ``key``. No rename is involved.
        """
        path = _join(self._root, key)
        directory, name = os.path.split(path)
        try:
            _makedirs_durable(directory)
            if not exclusive:
                _write_file(path, data)
            else:
                # The time in the name lets gc tell a crashed write's leftover from a live one.
                tmp = os.path.join(directory, f".{name}.{int(time.time())}-{uuid.uuid4().hex}.tmp")
                _write_file(tmp, data)
                try:
                    os.link(tmp, path)
                except FileExistsError as e:
                    raise PreconditionFailed(path) from e
                finally:
                    os.unlink(tmp)
            _fsync_dir(directory)
        except PreconditionFailed:
            raise
        except OSError as e:
            raise self._error("write", key, e) from e

    def start_write(self, key: str, pieces: Sequence[bytes | memoryview]) -> Callable[[], None]:
        self.write(key, pieces)  # straight from the caller's buffers: no copy
        return _written

    def delete(self, key: str) -> None:
        path = _join(self._root, key)
        try:
            os.unlink(path)
            _fsync_dir(os.path.dirname(path))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise self._error("delete", key, e) from e

    def plan_restore(self, nbytes: int) -> None:
        """Nothing to size: chunk files are read straight into the restored arrays."""

    def delete_many(self, keys: Iterable[str]) -> None:
        """Deletes ``keys`` one by one (a file system has no batch delete), then makes
        each directory they were in durable once."""
        directories = set()
        for key in keys:
            path = _join(self._root, key)
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            except OSError as e:
                raise self._error("delete", key, e) from e
            directories.add(os.path.dirname(path))
        for directory in sorted(directories):
            try:
                _fsync_dir(directory)
            except FileNotFoundError:
                continue  # another remover took the directory too
            except OSError as e:
                raise self._error("delete", directory, e) from e

    def delete_prefix(self, prefix: str) -> None:
        """Removes the directory tree; retries while another process still writes into it.

        Another process removing the same tree (a fenced writer abandoning its
        attempt while the new writer collects it) takes entries from under
        ``rmtree``, which then stops with FileNotFoundError halfway: the walk
        starts again until the tree is gone. A tree still there after 30 s of walks
        raises: a writer that fills it faster than they empty it would make each walk
        longer than the last.
        """
        path = _join(self._root, prefix.rstrip("/"))
        refilled = taken = 0
        deadline = time.monotonic() + _RMTREE_DEADLINE_S
        while True:
            try:
                shutil.rmtree(path)
                _fsync_dir(os.path.dirname(path))
                return
            except FileNotFoundError as e:
                taken += 1
                if not os.path.lexists(path):
                    return
                if taken == _RMTREE_RACES or time.monotonic() > deadline:
                    raise self._error("delete", prefix, e) from e
            except OSError as e:
                refilled += 1
                late = time.monotonic() > deadline
                if e.errno != errno.ENOTEMPTY or refilled == _RMTREE_ATTEMPTS or late:
                    raise self._error("delete", prefix, e) from e

    def list(self, prefix: str) -> list[str]:
        base = _join(self._root, prefix.rstrip("/")) if prefix else self._root
        try:
            return sorted(self._walk(base))
        except OSError as e:
            raise self._error("list", prefix, e) from e

    def _walk(self, base: str) -> Iterator[str]:
        """Keys of the files under ``base`` (``os.walk``'s rules: symlinked directories
        are not entered, a directory that vanishes is skipped), from ``scandir``'s
        entry types alone: a commit lists every chunk of the attempt."""
        if not os.path.isdir(base):
            return
        rel = os.path.relpath(base, self._root).replace(os.sep, "/")
        stack = [(base, "" if rel == "." else rel + "/")]
        while stack:
            path, prefix = stack.pop()
            try:
                with os.scandir(path) as entries:
                    for entry in entries:
                        if not entry.is_dir():
                            yield prefix + entry.name
                        elif not entry.is_symlink():
                            stack.append((entry.path, f"{prefix}{entry.name}/"))
            except OSError:
                continue

    def age(self, key: str) -> float | None:
        """Seconds since ``key``'s mtime, against the mtime of a file created now.

        Both times come from the clock of whoever stamps the files (this
        kernel, or the NFS server), not from this process's ``time.time()``.
        On a root this process cannot write, the probe falls back to
        ``time.time()``.
        """
        try:
            written = os.stat(_join(self._root, key)).st_mtime
        except FileNotFoundError:
            return None
        except OSError as e:
            raise self._error("stat", key, e) from e
        return max(0.0, self._now() - written)

    def _now(self) -> float:
        """The file system's current time: the mtime of a new, empty file."""
        probe = os.path.join(self._root, f"{_CLOCK_PROBE}{uuid.uuid4().hex}")
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                return os.fstat(fd).st_mtime
            finally:
                os.close(fd)
                os.unlink(probe)
        except OSError:
            return time.time()

    def kvstore_spec(self, prefix: str) -> dict[str, Any]:
        return {"driver": "file", "path": _join(self._root, prefix.rstrip("/")) + "/"}

    def context_spec(self) -> dict[str, Any]:
        return {
            "file_io_concurrency": {"limit": self._io_concurrency},
            "file_io_sync": True,
        }


def _write_file(path: str, data: bytes | Sequence[bytes | memoryview]) -> None:
    """Writes ``data`` (or its pieces, in order, by ``writev``) to ``path`` and fsyncs it."""
    pieces = [data] if isinstance(data, (bytes, bytearray, memoryview)) else list(data)
    views = [memoryview(p).cast("B") for p in pieces if len(p)]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        i = 0
        while i < len(views):
            written = os.writev(fd, views[i : i + _IOV_MAX])
            while i < len(views) and written >= len(views[i]):  # skip what went out whole
                written -= len(views[i])
                i += 1
            if written:
                views[i] = views[i][written:]
        os.fsync(fd)
    finally:
        os.close(fd)


_IOV_MAX = 1024
"""The most buffers one ``writev`` takes (Linux's IOV_MAX)."""


def _written() -> None:
    """The wait of a write that is already durable."""
