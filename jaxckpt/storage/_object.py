"""Object-store roots (``gs://bucket/prefix``, ``s3://bucket/prefix``) on TensorStore kvstores.

The small objects of the commit protocol (markers, manifests) go through the
same TensorStore ``gcs`` / ``s3`` kvstore drivers as the array data, so one set
of credentials, endpoints and retry settings serves both paths.

:class:`ObjectStorage` is the shared base of one class per cloud (``_s3.py``,
``_gcs.py``), which supply the endpoint, spec members, credentials, direct reader
and (S3) botocore's create-only PUTs and batch deletes; the backend table in
:mod:`jaxckpt.storage` maps each scheme to its class. The base is built in layers,
one concern each: the requests (kvstore, names, errors, retries:
:mod:`~jaxckpt.storage._objrequests`), create-only writes and their probe
(:mod:`~jaxckpt.storage._objcreate`), and here the ``Storage`` operations: reads
(ranged, under a memory budget: :mod:`~jaxckpt.storage._ranged`), writes, deletes
and listing.
"""

from __future__ import annotations

import errno
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from jaxckpt import _pools as pools
from jaxckpt.errors import StorageError
from jaxckpt.storage._http import DirectReadError
from jaxckpt.storage._objcreate import CreateOnlyWrites
from jaxckpt.storage._options import DIRECT_PART_BYTES
from jaxckpt.storage._ranged import RangedReader, ShortObjectError

__all__ = ["ObjectStorage"]


class ObjectStorage(CreateOnlyWrites):
    """A checkpoint root in a bucket, accessed through TensorStore: the shared base of
    one class per cloud (:class:`~jaxckpt.storage._s3.S3Storage`,
    :class:`~jaxckpt.storage._gcs.GcsStorage`), which supply the endpoint, the
    TensorStore driver and spec members, credentials and the direct reader.

    Use :func:`jaxckpt.storage.open_storage` rather than constructing these directly.
    """

    # -- reads ---------------------------------------------------------------

    def read_buffer(self, key: str, size: int | None = None) -> bytes | np.ndarray | None:
        """The object's bytes; with its expected ``size``, in an aligned, writable buffer.

        With ``size`` the object is read by ranged GETs under the
        ``read_ahead_bytes`` budget (:mod:`jaxckpt.storage._ranged`); the buffer can
        become a jax array without a copy. An object shorter than ``size`` is
        read whole, so the caller's size check names the difference.
        """
        if size is None or size <= 0:
            return self.read(key)
        name = self._name(key)
        try:
            buffer = self._ranged.read(name, size)
        except ShortObjectError:
            return self.read(key)
        if buffer is None:
            self._check_bucket("read", name)
        return buffer

    def plan_restore(self, nbytes: int) -> None:
        """Sizes the memory budget of a restore of ``nbytes`` (see ``read_ahead_bytes``)."""
        part, ahead = self._options.budget(nbytes)
        self._ranged.set_budget(part_bytes=part, ahead_bytes=ahead)

    @property
    def _ranged(self) -> RangedReader:
        """One reader per storage object, so all threads share one memory budget."""
        kv = self._kv
        part, ahead = self._options.budget(0)
        with self._open_lock:
            if self._reader is None:
                self._reader = RangedReader(
                    kv,
                    part_bytes=part,
                    ahead_bytes=ahead,
                    timeout_s=self._options.timeout_s,
                    error=self._error,
                    call=self._call,
                    direct=self._direct_reader() if self._options.direct_reads else None,
                    direct_part_bytes=self._options.read_part_bytes or DIRECT_PART_BYTES,
                )
            return self._reader

    def read(self, key: str) -> bytes | None:
        name = self._name(key)
        result = self._call("read", name, lambda: self._kv.read(name))
        if result.state != "value":
            self._check_bucket("read", name)
            return None
        return bytes(result.value)

    def read_range(self, key: str, offset: int, size: int) -> bytes | np.ndarray | None:
        """``size`` bytes from ``offset`` (a span of a pack object), in an aligned buffer.

        Read like :meth:`read_buffer`: ranged GETs of at most ``read_part_bytes``
        under the ``read_ahead_bytes`` budget, copied into a 64-byte aligned,
        writable buffer whose chunk slices become jax arrays without a copy.
        If the object is shorter than the range, what it has there comes back.
        """
        name = self._name(key)
        if size <= 0:
            return b""
        try:
            buffer = self._ranged.read(name, size, offset)
        except ShortObjectError:
            return self._read_range_short(key, offset, size)
        if buffer is None:
            self._check_bucket("read", name)
        return buffer

    def _read_range_short(self, key: str, offset: int, size: int) -> bytes | None:
        """The bytes an object has in ``[offset, offset + size)`` (it is shorter than that)."""
        name = self._name(key)
        try:
            result = self._call(
                "read", name, lambda: self._kv.read(name, byte_range=slice(offset, offset + size))
            )
        except StorageError as e:
            if not any(m in str(e) for m in ("OUT_OF_RANGE", "Unexpected Content-Range")):
                raise
            whole = self.read(key)  # the object is shorter than the range: hand back the rest
            return None if whole is None else whole[offset : offset + size]
        if result.state != "value":
            self._check_bucket("read", name)
            return None
        return bytes(result.value)

    def age(self, key: str) -> float | None:
        """Seconds since ``key`` was written, from one response of the store: the
        object's modification time against the response's ``Date``.

        None when the key is missing, or without a direct reader (botocore or
        google-auth not installed, a proxy in the environment, or
        ``direct_reads=False``).
        """
        direct = self._ranged.direct
        if direct is None:
            return None
        name = self._name(key)
        try:
            return direct.age(name)
        except DirectReadError as e:
            where = f"{self._scheme}://{self._bucket}/{name}"
            raise StorageError(errno.EIO, f"cannot stat {where}: {e}") from e

    # -- writes, deletes and listing ---------------------------------------

    def write(self, key: str, data: bytes, *, exclusive: bool = False) -> None:
        name = self._name(key)
        if not exclusive:
            body = bytes(data)  # bytes: no copy
            self._call("write", name, lambda: self._kv.write(name, body))
            self._bucket_checked = True  # a plain PUT into a missing bucket fails
            return
        self._write_exclusive(name, bytes(data))

    def start_write(self, key: str, pieces: Sequence[bytes | memoryview]) -> Callable[[], None]:
        name = self._name(key)

        def submit() -> Any:
            return pools.pool("bodies", 1).submit(self._submit_body, name, pieces).result()

        first = submit()

        def wait() -> None:
            # A retry joins the body again from ``pieces``, which the caller keeps until
            # this returns: the body itself is not kept while the first attempt is in flight.
            self._call("write", name, submit, first)
            self._bucket_checked = True

        return wait

    def _submit_body(self, name: str, pieces: Sequence[bytes | memoryview]) -> Any:
        """Joins ``pieces`` into the request body and hands it to TensorStore (which keeps
        its own copy): the write's future.

        Every body is joined on the one ``bodies`` thread. glibc serves a block below
        its mmap ceiling (32 MiB) from the allocating thread's arena and keeps it
        resident once freed, so bodies joined on each upload thread stayed resident
        one per thread (a first save's extra memory doubled); one thread reuses one
        block, still warm, which also makes the join itself faster.
        """
        return self._kv.write(name, b"".join(pieces))

    def delete(self, key: str) -> None:
        name = self._name(key)
        self._call("delete", name, lambda: self._kv.write(name, None))
        self._check_bucket("delete", name)

    def delete_many(self, keys: Iterable[str]) -> None:
        """Deletes ``keys`` (missing ones are not errors): on S3 by ``DeleteObjects``
        requests of up to 1,000 keys; elsewhere one request per key, all in flight."""
        names = [self._name(key) for key in keys]
        if names:
            self._delete_names(names)
            self._check_bucket("delete", names[0])

    def _delete_names(self, names: Sequence[str]) -> None:
        """Deletes the objects ``names``, all requests in flight (the S3 class batches them)."""
        if not names:
            return
        # Deleted one by one (TensorStore's delete_range trusts the server's listing,
        # and an emulator that ignores ranges turns it into "delete the bucket"); the
        # requests run concurrently, and each is retried on its own.
        futures = [(name, self._kv.write(name, None)) for name in names]
        for name, future in futures:
            self._call("delete", name, functools.partial(self._kv.write, name, None), future)

    def _list_names(self, directory: str) -> list[str]:
        if directory:
            end = directory[:-1] + chr(ord(directory[-1]) + 1)
            key_range = ts.KvStore.KeyRange(directory, end)
        else:
            key_range = ts.KvStore.KeyRange()
        found = self._call("list", directory, lambda: self._kv.list(key_range))
        # Filter again: some emulators ignore the range and list the whole bucket.
        names = (raw.decode("utf-8") for raw in found)
        return [n for n in names if n.startswith(directory) and not n.endswith("/")]

    def delete_prefix(self, prefix: str) -> None:
        self._delete_names(self._list_names(self._dir(prefix)))

    def list(self, prefix: str) -> list[str]:
        directory = self._dir(prefix)
        root = f"{self._prefix}/" if self._prefix else ""
        return sorted(name[len(root) :] for name in self._list_names(directory))
