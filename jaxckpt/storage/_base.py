"""The interface every checkpoint root implements, and its one control-flow error.

The commit protocol and the CLI only ever talk to :class:`Storage`: read,
write (optionally create-only), delete and list keys under a root. Bulk array
data does not go through this interface; it is written by TensorStore, which
gets its kvstore spec from :meth:`TensorStoreStorage.kvstore_spec`, a capability
beside the core interface. Nothing here relies on
rename, so the same protocol works on POSIX file systems and object stores.

Keys are ``/``-separated paths relative to the root. Failures of the store are
:class:`jaxckpt.StorageError` (naming the root and key); a create-only write
that finds its key taken is :class:`PreconditionFailed`, which the commit
protocol catches.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from jaxckpt.errors import StorageError


class PreconditionFailed(Exception):
    """A create-only write found the key already present (the commit protocol handles it)."""


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

    def plan_restore(self, nbytes: int) -> None:
        """Sizes the read budget of a restore of ``nbytes`` before its reads start
        (object stores: ``read_ahead_bytes``); a local root has none and ignores it."""
        ...

    def write(self, key: str, data: bytes, *, exclusive: bool = False) -> None:
        """Writes ``data`` durably; with ``exclusive``, only if ``key`` is absent.

        Raises:
          PreconditionFailed: ``exclusive`` and the key already exists.
          StorageError: the store failed.
        """
        ...

    def start_write(self, key: str, pieces: Sequence[bytes | memoryview]) -> Callable[[], None]:
        """Starts a plain :meth:`write` of the concatenated ``pieces`` and returns the wait
        for it to be durable (it raises :class:`StorageError` like :meth:`write`).

        A local root writes the pieces as they are (``writev``, no copy); an
        object store joins them into its one request body and keeps only that,
        so a pack upload holds its bytes once while in flight.
        """
        ...

    def delete(self, key: str) -> None:
        """Deletes one key; a missing key is not an error."""
        ...

    def delete_many(self, keys: Iterable[str]) -> None:
        """Deletes several keys; missing keys are not errors.

        Object stores send them in batches where the store has a batch delete
        (S3 ``DeleteObjects``: 1,000 keys a request) instead of one request each.
        """
        ...

    def delete_prefix(self, prefix: str) -> None:
        """Deletes every key under ``prefix`` (which ends with ``/``), listed and then
        removed as :meth:`delete_many` does."""
        ...

    def list(self, prefix: str) -> list[str]:
        """Keys under ``prefix``, recursively, relative to the root, sorted."""
        ...

    def age(self, key: str) -> float | None:
        """Seconds since ``key`` was last written, by the store's own clock.

        Both ends of the interval are the store's timestamps (a file's mtime
        against a probe file's; an object's ``Last-Modified`` against the
        ``Date`` of the same response), so a client whose clock is off does
        not change it. None when the key is missing or the store cannot tell.
        """
        ...


@runtime_checkable
class TensorStoreStorage(Storage, Protocol):
    """A root TensorStore has a kvstore driver for: the capability that the zarr-array
    paths need (the plain layout's chunks, ``cp``'s re-encoding, ``verify``), asked for
    with :func:`tensorstore_backed`. The core :class:`Storage` does not require it, so a
    backend TensorStore cannot open (an in-memory test store, another cloud) needs
    only the core."""

    def kvstore_spec(self, prefix: str) -> dict[str, Any]:
        """A TensorStore kvstore spec for the keys under ``prefix``."""
        ...

    def context_spec(self) -> dict[str, Any]:
        """TensorStore context resources (retries, concurrency) for this store."""
        ...


def tensorstore_backed(storage: Storage) -> TensorStoreStorage:
    """``storage`` as a :class:`TensorStoreStorage`.

    Raises:
      StorageError: (``EOPNOTSUPP``) TensorStore has no driver for this root.
    """
    if not isinstance(storage, TensorStoreStorage):
        raise StorageError(
            errno.EOPNOTSUPP,
            f"{storage.uri}: TensorStore has no driver for this root (the plain layout, "
            "cp's re-encoding and verify read zarr arrays through TensorStore)",
        )
    return storage
