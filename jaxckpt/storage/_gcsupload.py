"""A local file as one GCS object, through a resumable upload (JSON API) streamed from it.

One ``POST .../upload/storage/v1/b/BUCKET/o?uploadType=resumable`` opens a session
whose metadata carries the file's MD5 (the store refuses to finalise an object whose
bytes differ); then one ``PUT`` per chunk (:func:`gcs_chunk_bytes`, multiples of
256 KiB) with ``Content-Range: bytes A-B/SIZE``, each body a
:class:`~jaxckpt.storage._upload.FileSlice` that :mod:`http.client` streams from the
file. The store answers ``308`` with the bytes it holds until the last chunk, then
``200`` with the object: the object appears whole or not at all. A chunk that fails
transiently (a dropped connection, ``408``/``429``/``5xx``) is retried with the root's
full-jitter backoff after asking the session how much it holds (``Content-Range:
bytes */SIZE``), from there.

Over HTTPS requests carry google-auth's application-default credentials (read-write
scope); over plain HTTP (an emulator) none, as the direct reader does. The session
URL must stay on the endpoint's host: the store is never asked to send the file (or
a token) elsewhere.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import http.client
import json
import logging
import os
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

from jaxckpt.errors import StorageError
from jaxckpt.storage._retry import RETRY_HTTP_STATUSES, Backoff, elapsed_note, unreachable
from jaxckpt.storage._upload import FileSlice, Progress, gcs_chunk_bytes

__all__ = ["GCS_PUBLIC", "resumable_upload"]

_log = logging.getLogger(__name__)

GCS_PUBLIC = "https://storage.googleapis.com"
_WRITE_SCOPE = "https://www.googleapis.com/auth/devstorage.read_write"
_READ = 1 << 20
_TRANSIENT = (ConnectionError, TimeoutError, http.client.HTTPException)

Authorize = Callable[[dict[str, str]], None]


class _Retry(Exception):
    """A request failed transiently (``status`` None: no answer)."""

    def __init__(self, why: str, status: int | None = None) -> None:
        super().__init__(why)
        self.status = status


def write_authorizer(base_url: str) -> Authorize | None:
    """Adds google-auth's bearer token (read-write scope) over HTTPS; None over HTTP.

    Raises:
      StorageError: google-auth is missing for an HTTPS endpoint (``EOPNOTSUPP``), or
        finds no credentials (``EACCES``).
    """
    if base_url.startswith("http://"):
        return None
    try:
        import google.auth
        import google.auth.exceptions
        import google.auth.transport.requests
    except ImportError as e:
        raise StorageError(
            errno.EOPNOTSUPP,
            f"uploading to {base_url} in parts needs google-auth: pip install 'jaxckpt[gcs]'",
        ) from e
    try:
        credentials = google.auth.default(scopes=[_WRITE_SCOPE])[0]
    except google.auth.exceptions.DefaultCredentialsError as e:
        raise StorageError(
            errno.EACCES, f"cannot upload to {base_url}: no Google credentials found ({e})"
        ) from e
    lock = threading.Lock()

    def authorize(headers: dict[str, str]) -> None:
        with lock:
            if not credentials.valid:
                credentials.refresh(google.auth.transport.requests.Request())
            credentials.apply(headers)

    return authorize


class _Connection:
    """One kept-alive connection to the endpoint (reopened after a failure)."""

    def __init__(self, base_url: str, timeout_s: float) -> None:
        parts = urllib.parse.urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) endpoint: {base_url!r}")
        self.origin = f"{parts.scheme}://{parts.netloc}"
        self._https, self._host, self._port = parts.scheme == "https", parts.hostname, parts.port
        self._timeout = timeout_s
        self._conn: http.client.HTTPConnection | None = None

    def request(
        self, method: str, target: str, headers: dict[str, str], body: Any = None
    ) -> tuple[int, dict[str, str], bytes]:
        if self._conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            self._conn = cls(self._host, self._port, timeout=self._timeout)
        try:
            self._conn.request(method, target, body=body, headers=headers)
            response = self._conn.getresponse()
            data = response.read()
        except BaseException:
            self.close()
            raise
        if response.getheader("Connection", "").lower() == "close":
            self.close()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, data

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _detail(body: bytes) -> str:
    """The message of a JSON API error body, else the body's start."""
    try:
        return str(json.loads(body)["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return body[:300].decode("utf-8", "replace")


def _file_md5(path: str, size: int) -> str:
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        for _ in range(0, size, _READ):
            h.update(f.read(_READ))
    return base64.b64encode(h.digest()).decode()


class _Resumable:
    """One resumable upload of a local file (see the module)."""

    def __init__(
        self, base_url: str, bucket: str, name: str, path: str, timeout_s: float, backoff: Backoff
    ) -> None:
        self.where = f"gs://{bucket}/{name}"
        self.path, self.size = path, os.path.getsize(path)
        self.md5 = _file_md5(path, self.size)
        self._bucket, self._name, self._backoff = bucket, name, backoff
        self._authorize = write_authorizer(base_url)
        self._conn = _Connection(base_url, timeout_s)
        self._started, self._retry = time.monotonic(), 0

    def _call(
        self, method: str, target: str, headers: dict[str, str], body: Any = None
    ) -> tuple[int, dict[str, str], bytes]:
        """One request; raises :class:`_Retry` when it failed transiently."""
        if self._authorize is not None:
            self._authorize(headers)
        try:
            status, got, data = self._conn.request(method, target, headers, body)
        except _TRANSIENT as e:
            raise _Retry(f"{type(e).__name__}: {e}") from e
        if status in RETRY_HTTP_STATUSES:
            raise _Retry(f"HTTP {status}: {_detail(data)}", status)
        self._started, self._retry = time.monotonic(), 0  # the deadline runs from the last answer
        return status, got, data

    def _wait(self, e: _Retry) -> None:
        """Sleeps before the next attempt, or raises once the backoff gives up."""
        delay = self._backoff.delay(
            self._retry, self._started, unreachable=unreachable(e.__cause__ or e)
        )
        if delay is None:
            note = elapsed_note(self._retry + 1, self._started)
            raise StorageError(errno.ETIMEDOUT, f"cannot write {self.where}: {e}{note}") from e
        self._retry += 1
        _log.debug("upload of %s: %s; retry %d in %.2f s", self.where, e, self._retry, delay)
        time.sleep(delay)

    def _failed(self, action: str, status: int, data: bytes) -> StorageError:
        code = {404: errno.ENOENT, 401: errno.EACCES, 403: errno.EACCES}.get(status, errno.EIO)
        return StorageError(code, f"cannot {action} {self.where}: HTTP {status}: {_detail(data)}")

    def start(self) -> str:
        """Opens the session (its metadata carries the MD5); returns its request target."""
        quoted = urllib.parse.quote(self._bucket, safe="")
        query = urllib.parse.urlencode({"uploadType": "resumable", "name": self._name})
        meta = json.dumps({"name": self._name, "md5Hash": self.md5}).encode()
        headers = {
            "Content-Type": "application/json; charset=UTF-8",
            "Content-Length": str(len(meta)),
            "X-Upload-Content-Type": "application/octet-stream",
            "X-Upload-Content-Length": str(self.size),
        }
        while True:
            try:
                target = f"/upload/storage/v1/b/{quoted}/o?{query}"
                status, got, data = self._call("POST", target, dict(headers), meta)
                break
            except _Retry as e:
                self._wait(e)
        if status != 200:
            raise self._failed("start an upload of", status, data)
        location = got.get("location", "")
        session = urllib.parse.urlsplit(location)
        if f"{session.scheme}://{session.netloc}" != self._conn.origin:
            raise StorageError(
                errno.EPROTO,
                f"cannot write {self.where}: the upload session {location!r} is not on "
                f"{self._conn.origin}",
            )
        return session.path + (f"?{session.query}" if session.query else "")

    def send(self, target: str, chunk: int, progress: Progress | None) -> int:
        """Sends the file from the start of the session in chunks; returns the chunks sent."""
        offset, sent, ask = 0, 0, False
        while True:
            length = min(chunk, self.size - offset)
            asked = ask
            try:
                if ask:  # after a failure: how much the session holds
                    headers = {"Content-Length": "0", "Content-Range": f"bytes */{self.size}"}
                    status, got, data = self._call("PUT", target, headers)
                    ask = False
                else:
                    last = offset + length - 1
                    span = (
                        f"bytes {offset}-{last}/{self.size}" if length else f"bytes */{self.size}"
                    )
                    headers = {"Content-Length": str(length), "Content-Range": span}
                    with FileSlice.open(self.path, offset, length) as body:
                        status, got, data = self._call(
                            "PUT", target, headers, body if length else None
                        )
                    sent += 1
            except _Retry as e:
                self._wait(e)
                ask = True
                continue
            if status in (200, 201):
                self._check(data)
                if progress is not None and self.size > offset:
                    progress(self.size - offset)
                return sent
            if status != 308:
                raise self._failed("write", status, data)
            held = _held(got)
            if progress is not None and held > offset:
                progress(held - offset)
            if held <= offset and length and not asked:  # none of it kept: as a failure
                self._wait(_Retry(f"the store kept none of bytes {offset}-{offset + length - 1}"))
            offset = held

    def _check(self, data: bytes) -> None:
        stored = json.loads(data or b"{}").get("md5Hash")
        if stored is not None and stored != self.md5:
            raise StorageError(
                errno.EIO, f"{self.where}: the store holds MD5 {stored}, the file has {self.md5}"
            )

    def close(self) -> None:
        self._conn.close()


def _held(got: dict[str, str]) -> int:
    """The bytes a session holds, from a 308's ``Range: bytes=0-N`` (none: 0)."""
    text = got.get("range", "")
    return int(text.rpartition("-")[2]) + 1 if text.startswith("bytes=0-") else 0


def resumable_upload(
    base_url: str,
    bucket: str,
    name: str,
    path: str,
    budget: int,
    *,
    timeout_s: float,
    backoff: Backoff,
    progress: Progress | None = None,
) -> int:
    """Uploads the file ``path`` as ``gs://bucket/name`` in chunks of about ``budget``
    bytes (:func:`gcs_chunk_bytes`); returns the number of chunks sent.

    Raises:
      StorageError: the store refused a request, failed past the backoff's deadline,
        or kept bytes other than the file's (naming the object).
      OSError: the file cannot be read.
    """
    upload = _Resumable(base_url, bucket, name, path, timeout_s, backoff)
    try:
        return upload.send(upload.start(), gcs_chunk_bytes(budget), progress)
    finally:
        upload.close()
