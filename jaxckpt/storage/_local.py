"""Storage roots: one small interface, one implementation per kind of store.

The commit protocol and the CLI only ever talk to :class:`Storage`: read,
write (optionally create-only), delete and list keys under a root. Bulk array
data does not go through this interface; it is written by TensorStore, which
gets its kvstore spec from :meth:`Storage.kvstore_spec`. Nothing here relies on
rename, so the same protocol works on POSIX file systems and object stores.

Keys are ``/``-separated paths relative to the root.
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import numpy as np

from jaxckpt.errors import StorageError

_RMTREE_ATTEMPTS = 8  # a zombie writer may create files while its attempt is removed
_RMTREE_RACES = 10_000  # walks restarted because another remover took an entry first


class PreconditionFailed(Exception):
    """A create-only write found the key already present."""


@runtime_checkable
class Storage(Protocol):
    """The operations the commit protocol needs from a checkpoint root."""

    @property
    def uri(self) -> str:
        """The root's URI, for messages and for TensorStore."""
        ...

    def read(self, key: str) -> bytes | None:
        """Returns the object's bytes, or None when it does not exist."""
        ...

    def read_buffer(self, key: str, size: int | None = None) -> bytes | np.ndarray | None:
        """Like :meth:`read`, for large objects: a buffer the caller may keep.

        Local roots return a 64-byte-aligned numpy buffer filled by ``readinto``
        (no extra copy, and aligned so XLA's CPU client can alias it). Object
        stores do the same when ``size``, the expected size, is given: ranged
        GETs in parallel under a memory budget.
        """
        ...

    def read_range(self, key: str, offset: int, size: int) -> bytes | np.ndarray | None:
        """Bytes ``[offset, offset + size)`` of an object (one ranged request), or None
        when it does not exist; fewer bytes when the object ends earlier."""
        ...

    def write(self, key: str, data: bytes, *, exclusive: bool = False) -> None:
        """Writes ``data`` durably; with ``exclusive``, only if ``key`` is absent.

        Raises:
          PreconditionFailed: ``exclusive`` and the key already exists.
          StorageError: the store failed.
        """
        ...

    def delete(self, key: str) -> None:
        """Deletes one key; a missing key is not an error."""
        ...

    def delete_prefix(self, prefix: str) -> None:
        """Deletes every key under ``prefix`` (which ends with ``/``)."""
        ...

    def list(self, prefix: str) -> list[str]:
        """Keys under ``prefix``, recursively, relative to the root, sorted."""
        ...

    def kvstore_spec(self, prefix: str) -> dict[str, Any]:
        """A TensorStore kvstore spec for the keys under ``prefix``."""
        ...

    def context_spec(self) -> dict[str, Any]:
        """TensorStore context resources (retries, concurrency) for this store."""
        ...


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
                done = _pread_into(f.fileno(), buffer, 0)
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
                done = _pread_into(f.fileno(), buffer, offset)
                return buffer[:done]  # short if the object ends early: the caller's size check
        except FileNotFoundError:
            return None
        except OSError as e:
            raise self._error("read", key, e) from e

    def write(self, key: str, data: bytes, *, exclusive: bool = False) -> None:
        """Writes and fsyncs ``key``; with ``exclusive``, atomically and create-only.

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

    def delete(self, key: str) -> None:
        path = _join(self._root, key)
        try:
            os.unlink(path)
            _fsync_dir(os.path.dirname(path))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise self._error("delete", key, e) from e

    def delete_prefix(self, prefix: str) -> None:
        """Removes the directory tree; retries while another process still writes into it.

        Another process removing the same tree (a fenced writer abandoning its
        attempt while the new writer collects it) takes entries from under
        ``rmtree``, which then stops with FileNotFoundError halfway: the walk
        starts again until the tree is gone.
        """
        path = _join(self._root, prefix.rstrip("/"))
        refilled = taken = 0
        while True:
            try:
                shutil.rmtree(path)
                _fsync_dir(os.path.dirname(path))
                return
            except FileNotFoundError as e:
                taken += 1
                if not os.path.lexists(path):
                    return
                if taken == _RMTREE_RACES:
                    raise self._error("delete", prefix, e) from e
            except OSError as e:
                refilled += 1
                if e.errno != errno.ENOTEMPTY or refilled == _RMTREE_ATTEMPTS:
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

    def kvstore_spec(self, prefix: str) -> dict[str, Any]:
        return {"driver": "file", "path": _join(self._root, prefix.rstrip("/")) + "/"}

    def context_spec(self) -> dict[str, Any]:
        return {
            "file_io_concurrency": {"limit": self._io_concurrency},
            "file_io_sync": True,
        }


def _pread_into(fd: int, buffer: np.ndarray, offset: int) -> int:
    """Fills ``buffer`` from byte ``offset`` of ``fd``; the bytes read (fewer at end of file)."""
    view = buffer.data
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if not n:
            break
        done += n
    return done


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
    """
    if size >= MAPPED_BYTES and alignment <= mmap.PAGESIZE:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        return np.frombuffer(mmap.mmap(-1, size, flags=flags), np.uint8)
    raw = np.empty(size + alignment, np.uint8)
    offset = -raw.ctypes.data % alignment
    return raw[offset : offset + size]


def _write_file(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _makedirs_durable(path: str) -> None:
    """Creates ``path`` and its parents, fsyncing each new directory's parent."""
    if os.path.isdir(path):
        return
    parent = os.path.dirname(path)
    if parent != path:
        _makedirs_durable(parent)
    try:
        os.mkdir(path)
    except FileExistsError:
        return
    _fsync_dir(parent)


def open_storage(root: str | os.PathLike[str], **kwargs: Any) -> Storage:
    """Returns the :class:`Storage` for a root URI or path.

    Args:
      root: a local path, ``file://`` URI, ``gs://bucket/prefix`` or
        ``s3://bucket/prefix``.
      **kwargs: backend options: ``io_concurrency`` for local roots; ``endpoint``,
        ``region``, ``max_retries``, ... for object stores (see ``storage/_object.py``).

    Raises:
      StorageError: the URI scheme is not supported.
    """
    text = os.fspath(root)
    if text.startswith("file://"):
        return LocalStorage(text[len("file://") :], **kwargs)
    if "://" in text:
        scheme = text.split("://", 1)[0]
        if scheme in ("gs", "s3"):
            from jaxckpt.storage import _object

            return _object.open_object_storage(text, **kwargs)
        raise StorageError(
            errno.EINVAL,
            f"unsupported checkpoint root {text!r}: use a path, file://, gs:// or s3://",
        )
    if not text:
        raise StorageError(errno.EINVAL, "checkpoint root is empty")
    return LocalStorage(text, **kwargs)
