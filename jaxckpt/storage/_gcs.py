"""``gs://bucket/prefix`` roots: :class:`ObjectStorage` on TensorStore's ``gcs`` driver.

Endpoints. TensorStore's ``gcs`` spec and context have no endpoint member
(checked against tensorstore 0.1.86): its driver reads the process-wide
``TENSORSTORE_GCS_HTTP_URL`` environment variable (or the
``--tensorstore_gcs_http_url`` absl flag) each time it opens a driver. An
explicit ``endpoint`` or the ``STORAGE_EMULATOR_HOST`` that Google's client
libraries honour is therefore copied into ``TENSORSTORE_GCS_HTTP_URL`` when the
storage is opened -- a process-wide side effect, logged when it redirects an
earlier endpoint -- so one process should use one GCS endpoint. Without either,
opening a ``gs://`` root changes nothing in the environment.

The process's first GCS request runs with stderr captured, so that TensorStore's
credential lookup lines do not reach a command's output
(:func:`~jaxckpt.storage._tsenv.quiet_gcs_auth`).
"""

from __future__ import annotations

import tensorstore as ts

from jaxckpt.storage._cloudreads import gcs_reader
from jaxckpt.storage._gcsupload import GCS_PUBLIC, resumable_upload
from jaxckpt.storage._http import DirectReader
from jaxckpt.storage._object import ObjectStorage
from jaxckpt.storage._options import ObjectStoreOptions
from jaxckpt.storage._tsenv import quiet_gcs_auth, resolve_gcs_endpoint
from jaxckpt.storage._upload import Progress
from jaxckpt.storage._uri import RootURI

__all__ = ["GcsStorage"]

_AUTH_PROBE = ".jaxckpt-probe/auth"
_AUTH_PROBE_S = 10.0
"""The longest the first request waits with stderr captured."""
_UPLOAD_TIMEOUT_S = 300.0
"""The socket timeout of an upload's requests when ``timeout_s`` is None."""


class GcsStorage(ObjectStorage):
    """A checkpoint root in a Google Cloud Storage bucket."""

    scheme = "gs"
    driver = "gcs"

    def __init__(self, root: RootURI, options: ObjectStoreOptions) -> None:
        super().__init__(root, options)
        self._endpoint = resolve_gcs_endpoint(options.endpoint)

    def _opened(self, store: ts.KvStore) -> None:
        probe = self._name(_AUTH_PROBE)  # sent inside: the lookup runs with the request
        quiet_gcs_auth(lambda: store.read(probe).result(timeout=_AUTH_PROBE_S))

    def _tried(self) -> str:
        if self._endpoint and self._endpoint.startswith("http://"):
            return "; the store is unreachable: tried without credentials (plain HTTP)"
        where = "" if self._endpoint else " at https://storage.googleapis.com"
        return f"; the store is unreachable: tried{where} with Google's default credentials"

    def _direct_reader(self) -> DirectReader | None:
        timeout = self._options.timeout_s
        return gcs_reader(self._bucket, self._endpoint, timeout, self._backoff)

    def upload_file(
        self, key: str, path: str, *, part_bytes: int, progress: Progress | None = None
    ) -> int:
        """A resumable upload of the file ``path`` as ``key``, in chunks of about
        ``part_bytes`` (:mod:`jaxckpt.storage._gcsupload`); returns the chunks sent."""
        base = (self._endpoint or GCS_PUBLIC).rstrip("/")
        timeout = self._options.timeout_s or _UPLOAD_TIMEOUT_S
        name = self._name(key)
        return resumable_upload(
            base,
            self._bucket,
            name,
            path,
            part_bytes,
            timeout_s=timeout,
            backoff=self._backoff,
            progress=progress,
        )
