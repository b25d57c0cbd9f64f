"""The requests of one object-store root: the bucket-wide TensorStore kvstore, object
names, errors that name the object, and retries bounded by the deadline.

:class:`ObjectRequests` is the bottom of the object-store base
(:class:`~jaxckpt.storage._object.ObjectStorage`): create-only writes
(:mod:`jaxckpt.storage._objcreate`) and the ``Storage`` operations are built on its
:meth:`~ObjectRequests._call`. Each cloud's class supplies the endpoint, the kvstore
driver and spec members, credentials and the direct reader through the hooks here.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import tensorstore as ts

from jaxckpt.errors import StorageError
from jaxckpt.storage._http import DirectReader
from jaxckpt.storage._options import ObjectStoreOptions
from jaxckpt.storage._ranged import RangedReader
from jaxckpt.storage._retry import elapsed_note, tensorstore_transient, unreachable
from jaxckpt.storage._tsenv import bound_stalls
from jaxckpt.storage._tserror import duration, storage_error
from jaxckpt.storage._uri import RootURI

__all__ = ["PROBE_PREFIX", "ObjectRequests"]

_log = logging.getLogger(__name__)
_T = TypeVar("_T")

PROBE_PREFIX = ".jaxckpt-probe/"
"""Where the store's probes (bucket check, condition support) write and list."""
_OWN_RETRIES = 0
"""TensorStore's retries of the requests this class sends itself: none, so that every
retry is this class's (full jitter, bounded by the deadline)."""


class ObjectRequests:
    """The requests of a checkpoint root in a bucket (see the module docstring)."""

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
        self._bucket_checked = False
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

    def _credentials(self) -> dict[str, Any]:
        """TensorStore context resources for this cloud's credentials."""
        return {}

    def _tried(self) -> str:
        """``; tried ...``: where this root's requests went and with which credentials,
        for the error of a store that could not be reached."""
        return "; the store is unreachable"

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
            lost = unreachable(failure)
            delay = self._backoff.delay(retry, started, unreachable=lost)
            if delay is None:
                note = elapsed_note(retry + 1, started) + (self._tried() if lost else "")
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
        probe = self._name(f"{PROBE_PREFIX}bucket-check")
        self._call(action, name, lambda: self._kv.list(ts.KvStore.KeyRange(probe, probe + "\0")))
        self._bucket_checked = True

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
