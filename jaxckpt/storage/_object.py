"""Object-store roots (``gs://bucket/prefix``, ``s3://bucket/prefix``) on TensorStore kvstores.

The small objects of the commit protocol (markers, manifests) go through the
same TensorStore ``gcs`` / ``s3`` kvstore drivers as the array data, so one set
of credentials, endpoints and retry settings serves both paths.

Create-only writes on S3 are one ``PutObject`` with ``If-None-Match: *``
through botocore (:mod:`jaxckpt.storage._s3create`), which the store decides
atomically; without botocore or credentials, and on GCS, they use TensorStore's
"no value" generation as the ``if_equal`` condition (GCS: ``ifGenerationMatch=0``,
one request; S3: a HEAD, then the PUT). A write whose condition fails resolves
to an empty generation instead of raising. Servers that ignore the condition are detected
on the first create-only write (see :attr:`ObjectStorage.conditional_writes_enforced`)
and get a weaker fallback: check, write, read back and compare. The fallback
never overwrites a key that existed before the call, but two writers racing
for the same key can both succeed when one's write and read-back fit between
the other's check and write; the stored object is then the later write.

Each cloud is a subclass (``_s3.py``, ``_gcs.py``) supplying its endpoint, spec
members, credentials, direct reader and (S3) botocore client; the backend table in
:mod:`jaxckpt.storage` maps each scheme to its class.
"""

from __future__ import annotations

import errno
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar, TypeVar

import numpy as np
import tensorstore as ts

from jaxckpt import _pools as pools
from jaxckpt.errors import StorageError
from jaxckpt.storage._base import PreconditionFailed
from jaxckpt.storage._http import DirectReader, DirectReadError
from jaxckpt.storage._options import DIRECT_PART_BYTES, ObjectStoreOptions
from jaxckpt.storage._ranged import RangedReader, ShortObjectError
from jaxckpt.storage._retry import elapsed_note, tensorstore_transient
from jaxckpt.storage._s3create import CREATED, S3Creates, refuses_condition
from jaxckpt.storage._tsenv import bound_stalls
from jaxckpt.storage._tserror import duration, no_value_generation, storage_error
from jaxckpt.storage._uri import RootURI

__all__ = ["ObjectStorage"]

_log = logging.getLogger(__name__)
_T = TypeVar("_T")

_PROBE_PREFIX = ".jaxckpt-probe/"
_CREATE_ATTEMPTS = 3
_OWN_RETRIES = 0
"""TensorStore's retries of the requests this class sends itself: none, so that every
retry is this class's (full jitter, bounded by the deadline)."""


class ObjectStorage:
    """A checkpoint root in a bucket, accessed through TensorStore: the shared base of
    one class per cloud (:class:`~jaxckpt.storage._s3.S3Storage`,
    :class:`~jaxckpt.storage._gcs.GcsStorage`), which supply the endpoint, the
    TensorStore driver and spec members, credentials and the direct reader.

    Use :func:`jaxckpt.storage.open_storage` rather than constructing these directly.
    """

    scheme: ClassVar[str]
    """The URI scheme of this cloud's roots."""
    driver: ClassVar[str]
    """TensorStore's kvstore driver (and the prefix of its context resources)."""

    def __init__(self, root: RootURI, options: ObjectStoreOptions) -> None:
        if root.scheme != self.scheme:
            raise StorageError(errno.EINVAL, f"not a {self.scheme}:// root: {root.uri!r}")
        options.check_scheme(root.scheme)
        self._scheme = root.scheme
        self._bucket = root.bucket
        self._prefix = root.prefix
        self._options = options
        bound_stalls(options.timeout_s)
        self._driver = self.driver
        self._backoff = options.backoff()
        self._endpoint: str | None = None
        self._extra: dict[str, Any] = {}
        """Members of this cloud's kvstore spec beyond driver, bucket and path."""
        # The condition sent with create-only writes; an instance attribute so
        # that tests can simulate a server that ignores conditions.
        self._if_absent = no_value_generation()
        self._enforced: bool | None = None
        self._bucket_checked = False
        self._probe_lock = threading.Lock()
        self._open_lock = threading.Lock()
        self._store: ts.KvStore | None = None
        self._reader: RangedReader | None = None

    @property
    def _kv(self) -> ts.KvStore:
        """The bucket-wide kvstore, opened on first use (opening sends no request)."""
        with self._open_lock:
            if self._store is None:
                spec = {"driver": self._driver, "bucket": self._bucket, "path": "", **self._extra}
                context = ts.Context(self.context_spec(retries=_OWN_RETRIES))
                try:
                    self._store = ts.KvStore.open(spec, context=context).result()
                except (ValueError, NotImplementedError) as e:
                    raise self._error("open", "", e) from e
                self._opened(self._store)
            return self._store

    def _opened(self, store: ts.KvStore) -> None:
        """Called once the kvstore is open, before its first request."""

    def _direct_reader(self) -> DirectReader | None:
        """The bucket's reader of ``ObjectStoreOptions.direct_reads``, if it can have one."""
        return None

    @functools.cached_property
    def _s3_creates(self) -> S3Creates | None:
        """The store's own create-only PUTs and batch deletes (S3, through botocore),
        resolved on first use; None: TensorStore's conditions and one delete per key."""
        return None

    def _credentials(self) -> dict[str, Any]:
        """TensorStore context resources for this cloud's credentials."""
        return {}

    # -- naming and errors -------------------------------------------------

    @property
    def uri(self) -> str:
        base = f"{self._scheme}://{self._bucket}"
        return f"{base}/{self._prefix}" if self._prefix else base

    def __repr__(self) -> str:
        return f"ObjectStorage({self.uri!r}, endpoint={self._endpoint!r})"

    def _name(self, key: str) -> str:
        """The object name of ``key`` inside the bucket."""
        if key.startswith("/"):
            raise ValueError(f"storage keys are relative, got {key!r}")
        return f"{self._prefix}/{key}" if self._prefix else key

    def _dir(self, prefix: str) -> str:
        """The object-name prefix of the keys under ``prefix`` ('' or ends with '/')."""
        prefix = prefix.strip("/")
        name = self._name(prefix) if prefix else self._prefix
        return f"{name}/" if name else ""

    def _error(self, action: str, name: str, exc: BaseException, note: str = "") -> StorageError:
        return storage_error(
            action,
            f"{self._scheme}://{self._bucket}/{name}",
            exc,
            bucket=self._bucket,
            endpoint=self._endpoint,
            timeout_s=self._options.timeout_s,
            note=note,
        )

    def _call(
        self,
        action: str,
        name: str,
        start: Callable[[], ts.Future[_T]],
        first: ts.Future[_T] | None = None,
    ) -> _T:
        """One request's result (``start`` sends it; ``first``: already sent), retried
        while it fails transiently, with full-jitter backoff until the deadline.

        Each attempt may go ``timeout_s`` without an answer (then it is cancelled and
        retried: a repeated write or delete is harmless, and a create-only write
        checks what it finds, see :meth:`_create`).
        """
        started, retry = time.monotonic(), 0
        future = start() if first is None else first
        while True:
            try:
                return future.result(timeout=self._options.timeout_s)
            except TimeoutError as e:
                future.cancel()
                failure: BaseException = e
            except (ValueError, NotImplementedError) as e:
                if not tensorstore_transient(e):
                    raise self._error(action, name, e) from e
                failure = e
            delay = self._backoff.delay(retry, started)
            if delay is None:
                note = elapsed_note(retry + 1, started)
                raise self._error(action, name, failure, note) from failure
            retry += 1
            _log.debug("%s %s: %s; retry %d in %.2f s", action, name, failure, retry, delay)
            time.sleep(delay)
            future = start()

    def _check_bucket(self, action: str, name: str) -> None:
        """Raises StorageError about ``action`` on ``name`` unless the bucket exists.

        GCS and S3 report a missing bucket on reads and deletes as a missing
        object, so those calls list one key once per storage object.
        """
        if self._bucket_checked:
            return
        probe = self._name(f"{_PROBE_PREFIX}bucket-check")
        self._call(action, name, lambda: self._kv.list(ts.KvStore.KeyRange(probe, probe + "\0")))
        self._bucket_checked = True

    # -- Storage protocol --------------------------------------------------

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

    def write(self, key: str, data: bytes, *, exclusive: bool = False) -> None:
        name = self._name(key)
        if not exclusive:
            body = bytes(data)  # bytes: no copy
            self._call("write", name, lambda: self._kv.write(name, body))
            self._bucket_checked = True  # a plain PUT into a missing bucket fails
            return
        if self._conditions_enforced(name):
            self._create(name, bytes(data))
        else:
            self._create_fallback(name, bytes(data))

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

    def _create_once(self, name: str, data: bytes) -> bool:
        """One create-only write of ``name``: True if it created it, False if refused
        (the key exists; on S3 through TensorStore, also a missing bucket)."""
        creates = self._s3_creates
        if creates is not None:
            try:
                outcome = creates.create(name, data)
            except Exception as e:  # botocore's errors, named after the key
                if not refuses_condition(e):
                    raise self._error("write", name, e) from e
                _log.warning(
                    "%s refuses If-None-Match writes (%s); create-only writes go through "
                    "TensorStore from now on",
                    self._endpoint or "S3",
                    e,
                )
                self._s3_creates = None
            else:
                created = outcome == CREATED
                self._bucket_checked = self._bucket_checked or created
                return created
        stamp = self._call(
            "write", name, lambda: self._kv.write(name, data, if_equal=self._if_absent)
        )
        self._bucket_checked = self._bucket_checked or bool(stamp.generation)
        return bool(stamp.generation)

    def _create(self, name: str, data: bytes) -> None:
        for _ in range(_CREATE_ATTEMPTS):
            if self._create_once(name, data):
                return
            # The condition failed: the key exists, or (S3) the bucket is missing.
            existing = self._call("read", name, lambda: self._kv.read(name))
            if existing.state == "value":
                if bytes(existing.value) == data:
                    # Our own write: it landed, its response was lost, and the
                    # retry was refused. Create-only records are unique (markers
                    # name their attempt; epoch records their owner and time).
                    return
                raise PreconditionFailed(f"{self._scheme}://{self._bucket}/{name}")
            self._bucket_checked = False
            self._check_bucket("write", name)
            # The key was deleted between the write and the read: try again.
        raise StorageError(
            errno.EAGAIN,
            f"cannot write {self._scheme}://{self._bucket}/{name}: create-only write was refused "
            f"{_CREATE_ATTEMPTS} times although the key is absent",
        )

    def _create_fallback(self, name: str, data: bytes) -> None:
        where = f"{self._scheme}://{self._bucket}/{name}"
        if self._call("read", name, lambda: self._kv.read(name)).state == "value":
            raise PreconditionFailed(where)
        self._call("write", name, lambda: self._kv.write(name, data, if_equal=self._if_absent))
        stored = self._call("read", name, lambda: self._kv.read(name))
        if stored.state != "value" or bytes(stored.value) != data:
            raise PreconditionFailed(where)

    @property
    def conditional_writes_enforced(self) -> bool:
        """Whether the server refuses a create-only write to an existing key.

        Measured once, on first use, by creating a probe object under
        ``.jaxckpt-probe/`` twice and deleting it (three requests). This
        detects servers that ignore the condition altogether; it cannot tell an
        atomic check from TensorStore's HEAD-then-PUT on S3-compatible servers.
        """
        return self._conditions_enforced(self._name(f"{_PROBE_PREFIX}conditions"))

    def _conditions_enforced(self, for_name: str) -> bool:
        with self._probe_lock:
            if self._enforced is None:
                self._enforced = self._probe_conditions(for_name)
            return self._enforced

    def _probe_conditions(self, for_name: str) -> bool:
        """Measures condition support; errors name ``for_name``, the caller's key."""
        name = self._name(f"{_PROBE_PREFIX}{uuid.uuid4().hex}")
        try:
            if not self._create_once(name, b"1"):
                self._check_bucket("write", for_name)
                return True
            try:
                enforced = not self._create_once(name, b"2")
            finally:
                self._call("write", for_name, lambda: self._kv.write(name, None))
        except StorageError as e:
            raise StorageError(e.errno, f"{e.strerror} (while writing {for_name})") from e
        if not enforced:
            _log.warning(
                "%s ignores create-only conditions; using check-write-verify, which two "
                "concurrent writers of one key can both pass",
                self._endpoint or self._driver,
            )
        return enforced

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
        if not names:
            return
        creates = self._s3_creates
        if creates is not None:
            try:
                creates.delete(names)
                return
            except Exception as e:  # botocore's errors, and the keys S3 refused
                if not refuses_condition(e):
                    raise self._error("delete", getattr(e, "key", names[0]), e) from e
                _log.warning(
                    "%s refuses DeleteObjects (%s); deleting one by one", self._endpoint, e
                )
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

    def kvstore_spec(self, prefix: str) -> dict[str, Any]:
        path = self._dir(prefix)
        return {"driver": self._driver, "bucket": self._bucket, "path": path, **self._extra}

    def context_spec(self, *, retries: int | None = None) -> dict[str, Any]:
        """TensorStore's context for this root's I/O: for zarr arrays, which only
        TensorStore retries, as many retries as fit in the retry deadline
        (:meth:`Backoff.tensorstore_retries`); ``retries`` for requests retried here."""
        o = self._options
        retry = {
            "max_retries": self._backoff.tensorstore_retries() if retries is None else retries,
            "initial_delay": duration(o.initial_delay_s),
            "max_delay": duration(o.max_delay_s),
        }
        spec: dict[str, Any] = {
            f"{self._driver}_request_retries": retry,
            f"{self._driver}_request_concurrency": {"limit": o.request_concurrency},
        }
        spec.update(self._credentials())
        return spec
