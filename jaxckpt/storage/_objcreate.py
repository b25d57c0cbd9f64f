"""Create-only writes on an object store, and the probe of whether the server enforces them.

Create-only writes use TensorStore's "no value" generation as the ``if_equal``
condition (GCS: ``ifGenerationMatch=0``, one request; S3: a HEAD, then the PUT),
unless the cloud's class sends its own (S3 through botocore: one ``PutObject`` with
``If-None-Match: *``, see :mod:`jaxckpt.storage._s3create`). A write whose condition
fails resolves to an empty generation instead of raising. Servers that ignore the
condition are detected on the first create-only write (see
:attr:`CreateOnlyWrites.conditional_writes_enforced`) and get a weaker fallback: check,
write, read back and compare. The fallback never overwrites a key that existed before
the call, but two writers racing for the same key can both succeed when one's write and
read-back fit between the other's check and write; the stored object is then the later
write.
"""

from __future__ import annotations

import errno
import logging
import threading
import uuid

from jaxckpt.errors import StorageError
from jaxckpt.storage._base import PreconditionFailed
from jaxckpt.storage._objrequests import PROBE_PREFIX, ObjectRequests
from jaxckpt.storage._options import ObjectStoreOptions
from jaxckpt.storage._tserror import no_value_generation
from jaxckpt.storage._uri import RootURI

__all__ = ["CreateOnlyWrites"]

_log = logging.getLogger(__name__)

_CREATE_ATTEMPTS = 3


class CreateOnlyWrites(ObjectRequests):
    """Create-only writes of an object-store root (see the module docstring)."""

    def __init__(self, root: RootURI, options: ObjectStoreOptions) -> None:
        super().__init__(root, options)
        # The condition sent with create-only writes; an instance attribute so
        # that tests can simulate a server that ignores conditions.
        self._if_absent = no_value_generation()
        self._enforced: bool | None = None
        self._probe_lock = threading.Lock()

    def _write_exclusive(self, name: str, data: bytes) -> None:
        """Writes ``name`` unless it exists (:class:`PreconditionFailed` if it does)."""
        if self._conditions_enforced(name):
            self._create(name, data)
        else:
            self._create_fallback(name, data)

    def _create_once(self, name: str, data: bytes) -> bool:
        """One create-only write of ``name``: True if it created it, False if refused
        (the key exists; on S3 through TensorStore, also a missing bucket).

        Through TensorStore, with its "no value" generation as the condition; the S3
        class tries botocore's ``If-None-Match`` PUT first."""
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
        return self._conditions_enforced(self._name(f"{PROBE_PREFIX}conditions"))

    def _conditions_enforced(self, for_name: str) -> bool:
        with self._probe_lock:
            if self._enforced is None:
                self._enforced = self._probe_conditions(for_name)
            return self._enforced

    def _probe_conditions(self, for_name: str) -> bool:
        """Measures condition support; errors name ``for_name``, the caller's key."""
        name = self._name(f"{PROBE_PREFIX}{uuid.uuid4().hex}")
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
