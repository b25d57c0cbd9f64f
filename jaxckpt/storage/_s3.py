"""``s3://bucket/prefix`` roots: :class:`ObjectStorage` on TensorStore's ``s3`` driver.

The endpoint is ``endpoint``, else ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``
(S3-compatible stores: moto, MinIO), and goes into the kvstore spec with the
region; every client addresses the bucket path-style or virtual-hosted as
:class:`~jaxckpt.storage._s3address.S3Address` decides (``addressing_style``).
Create-only PUTs (``If-None-Match: *``) and batched deletes
(``DeleteObjects``) go through botocore when it is installed and finds
credentials (:mod:`jaxckpt.storage._s3create`); direct reads are signed by it.

>>> from jaxckpt.storage import open_storage
>>> storage = open_storage("s3://my-bucket/run1", region="eu-west-1")
>>> type(storage).__name__, storage.uri
('S3Storage', 's3://my-bucket/run1')
>>> storage.kvstore_spec("step_1/")["path"]
'run1/step_1/'
"""

from __future__ import annotations

import errno
import functools
import logging
import os
from collections.abc import Sequence
from typing import Any

import tensorstore as ts

from jaxckpt.errors import StorageError
from jaxckpt.storage._cloudreads import s3_reader
from jaxckpt.storage._http import DirectReader
from jaxckpt.storage._object import ObjectStorage
from jaxckpt.storage._options import ObjectStoreOptions
from jaxckpt.storage._s3address import S3Address, resolve_style
from jaxckpt.storage._s3create import CREATED, S3Creates, refuses_condition, s3_creates
from jaxckpt.storage._s3upload import multipart_upload
from jaxckpt.storage._tsenv import aws_credentials, quiet_s3_auth
from jaxckpt.storage._upload import Progress
from jaxckpt.storage._uri import RootURI

__all__ = ["S3Storage"]

_log = logging.getLogger(__name__)

_AUTH_PROBE = ".jaxckpt-probe/auth"
_AUTH_PROBE_S = 10.0
"""The longest the first request waits with stderr filtered."""
_CREATE_TIMEOUT_S = 300.0
"""botocore's connect and read timeout of a create-only PUT when ``timeout_s`` is None."""


_TS_VIRTUAL = (0, 1, 82)
"""The first TensorStore whose ``s3`` driver takes an empty bucket (virtual-hosted)."""


def _check_tensorstore(uri: str) -> None:
    """Raises StorageError (naming ``uri``) if TensorStore cannot address it virtual-hosted."""
    import importlib.metadata

    version = importlib.metadata.version("tensorstore")
    numbers = tuple(int(p) for p in version.split(".")[:3] if p.isdigit())
    if numbers < _TS_VIRTUAL:
        raise StorageError(
            errno.EINVAL,
            f"cannot open {uri} with addressing_style='virtual': tensorstore {version} "
            "addresses a custom endpoint path-style only; install tensorstore>=0.1.82",
        )


class S3Storage(ObjectStorage):
    """A checkpoint root in an S3 (or S3-compatible) bucket."""

    scheme = "s3"
    driver = "s3"

    def __init__(self, root: RootURI, options: ObjectStoreOptions) -> None:
        super().__init__(root, options)
        self._endpoint = (
            options.endpoint
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
            or None
        )
        self._region = (
            options.region
            or os.environ.get("AWS_REGION")
            or os.environ.get("AWS_DEFAULT_REGION")
            or "us-east-1"
        )
        style = resolve_style(options.addressing_style, root.uri)
        self._address = S3Address(
            bucket=self._bucket, region=self._region, endpoint=self._endpoint, style=style
        )
        self._extra.update(self._address.tensorstore_members())
        if self._extra["bucket"] == "":
            _check_tensorstore(root.uri)

    def _opened(self, store: ts.KvStore) -> None:
        probe = self._name(_AUTH_PROBE)  # the SDK's credential lookup runs with it
        quiet_s3_auth(lambda: store.read(probe).result(timeout=_AUTH_PROBE_S))

    def _direct_reader(self) -> DirectReader | None:
        timeout = self._options.timeout_s
        address = self._address
        return s3_reader(
            self._bucket, self._region, self._endpoint, timeout, self._backoff, style=address.style
        )

    @functools.cached_property
    def _s3_creates(self) -> S3Creates | None:
        timeout = self._options.timeout_s or _CREATE_TIMEOUT_S
        return s3_creates(self._address, timeout, self._backoff)

    def _credentials(self) -> dict[str, Any]:
        return aws_credentials()

    def _tried(self) -> str:
        keys = "the environment's keys" if aws_credentials() else "the AWS default chain"
        where = "" if self._endpoint else f" at {self._address.base_url}"
        return (
            f"; the store is unreachable: tried region {self._region}{where}, credentials: {keys}"
        )

    # -- botocore's create-only PUTs and batch deletes ------------------------

    def _create_once(self, name: str, data: bytes) -> bool:
        """One ``PutObject`` with ``If-None-Match: *`` (decided atomically by the store)
        through botocore; through TensorStore without botocore or credentials, or once
        the store refused the header."""
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
        return super()._create_once(name, data)

    def _delete_names(self, names: Sequence[str]) -> None:
        """``DeleteObjects`` requests of up to 1,000 keys through botocore; one request
        per key without it, or once the store refused the batch."""
        creates = self._s3_creates
        if names and creates is not None:
            try:
                creates.delete(names)
                return
            except Exception as e:  # botocore's errors, and the keys S3 refused
                if not refuses_condition(e):
                    raise self._error("delete", getattr(e, "key", names[0]), e) from e
                _log.warning(
                    "%s refuses DeleteObjects (%s); deleting one by one", self._endpoint, e
                )
        super()._delete_names(names)

    def upload_file(
        self, key: str, path: str, *, part_bytes: int, progress: Progress | None = None
    ) -> int:
        """A multipart upload of the file ``path`` as ``key``, in parts of about
        ``part_bytes`` (:mod:`jaxckpt.storage._s3upload`); returns the number of parts.

        Raises:
          StorageError: the store failed (naming the object), or botocore is missing or
            finds no credentials (``EOPNOTSUPP``).
        """
        name = self._name(key)
        creates = self._s3_creates
        if creates is None:
            raise StorageError(
                errno.EOPNOTSUPP,
                f"cannot upload {path} to s3://{self._bucket}/{name} in parts: that needs "
                "botocore (pip install 'jaxckpt[s3]') and credentials it finds",
            )
        try:
            return multipart_upload(creates, name, path, part_bytes, progress)
        except Exception as e:  # botocore's errors, named after the key; others as they are
            if type(e).__module__.startswith("botocore"):
                raise self._error("write", name, e) from e
            raise
