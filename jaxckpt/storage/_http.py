"""Ranged GETs of S3 and GCS objects straight into the caller's buffer.

TensorStore hands every read to Python as a new ``bytes`` object, copied out
of its own response buffer: a restore through it either holds twice the bytes
in flight or keeps few requests in flight. The restore's chunk
reads instead go over this module's own HTTP connections
(:mod:`http.client`), whose ``readinto`` writes each response body into the
array buffer it becomes: no response copy, and memory no larger than the
arrays, so every reader thread keeps a request in flight.

Only GETs of byte ranges go this way; writes, listings, markers and manifests
stay on TensorStore. Each cloud's addressing and request signing live in
:mod:`jaxckpt.storage._cloudreads`, which builds a :class:`DirectReader` per bucket.

A read that is throttled (``429``, ``503 SlowDown``) or fails transiently (other
5xx, a timeout, a dropped connection, a body cut short) is retried
here with the root's full-jitter backoff until its deadline
(:mod:`jaxckpt.storage._retry`); past the deadline it raises
:class:`StoreUnavailableError`, which fails the read (TensorStore would find the
same store). Throttling never turns direct reads off. A read that fails for any
other reason (a 4xx other than 404/408/416/429, a malformed response, a refused
connection) raises
:class:`DirectReadError`, and the caller reads that range through TensorStore;
:data:`FAILURES_BEFORE_OFF` of those in a row leave every later read to
TensorStore.
"""

from __future__ import annotations

import email.utils
import http.client
import logging
import os
import ssl
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

from jaxckpt.storage._retry import RETRY_HTTP_STATUSES, Backoff, elapsed_note, unreachable

_log = logging.getLogger(__name__)

FAILURES_BEFORE_OFF = 3
"""Consecutive failed direct reads (not counting throttling and transient failures, which
are retried here) after which a reader leaves every read to TensorStore."""

# What sending on a kept-alive connection that the server has closed raises.
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)

Authorize = Callable[[str, dict[str, str]], None]
"""Adds the authorization headers of a GET of a URL to ``headers``."""
Stamps = Callable[[http.client.HTTPResponse, bytes], "float | None"]
"""The ``Last-Modified`` time (seconds since the epoch, the store's clock) in a response."""


class DirectReadError(Exception):
    """A direct read failed; the caller reads the same range through TensorStore."""


class StoreUnavailableError(DirectReadError):
    """The store throttled or failed transiently until the retry deadline: the read fails."""


class _Transient(DirectReadError):
    """Throttling or a transient failure: retried after a backoff."""


# Connection failures worth retrying: reset, dropped, timed out (not refused: below).
_TRANSIENT_ERRORS = (ConnectionError, TimeoutError, http.client.IncompleteRead)


class DirectReader:
    """GETs of byte ranges of one bucket's objects, into caller buffers.

    Args:
      base_url: ``scheme://host[:port]`` of the service.
      object_path: the request path (with query) of an object name.
      authorize: signs a request (adds headers), or None for anonymous requests.
      timeout_s: the longest a request may go without progress (the socket
        timeout of each connect, send and receive); None waits forever.
      stat_path: the request path (with query) of an object's timestamps, and
        how to find the modification time in that response (for :meth:`age`).
      backoff: when to retry a throttled or transiently failed request; default
        :class:`~jaxckpt.storage._retry.Backoff`'s.
      proxy: ``http://HOST:PORT`` of an HTTP proxy to send each request through
        (absolute-form request lines; plain-HTTP ``base_url`` only), or None.
    """

    def __init__(
        self,
        base_url: str,
        object_path: Callable[[str], str],
        authorize: Authorize | None,
        timeout_s: float | None,
        stat_path: tuple[Callable[[str], str], Stamps] | None = None,
        backoff: Backoff | None = None,
        *,
        proxy: str | None = None,
    ) -> None:
        parts = urllib.parse.urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) base URL: {base_url!r}")
        self.base_url = f"{parts.scheme}://{parts.netloc}"
        self._https = parts.scheme == "https"
        self._tls: ssl.SSLContext | None = None  # made on the first HTTPS connection
        self._host = parts.hostname
        self._port = parts.port
        self._target = ""
        """Prepended to each request path: the base URL when the request goes to a proxy."""
        if proxy is not None:
            via = urllib.parse.urlsplit(proxy)
            if self._https or via.scheme != "http" or not via.hostname:
                raise ValueError(f"only plain HTTP goes through a proxy, got {proxy!r}")
            self._host, self._port, self._target = via.hostname, via.port, self.base_url
        self._object_path = object_path
        self._authorize = authorize
        self._timeout = timeout_s
        self._stat = stat_path
        self._backoff = backoff or Backoff()
        self._lock = threading.Lock()
        self._idle: list[http.client.HTTPConnection] = []
        self._pid = os.getpid()
        self._failures = 0
        self.enabled = True
        """False once :data:`FAILURES_BEFORE_OFF` reads in a row failed."""
        self.reads = 0
        """Ranges read here."""
        self.failed = 0
        """Ranges that failed here (and went to TensorStore)."""
        self.retries = 0
        """Requests sent again after throttling or a transient failure."""

    def _retrying(self, request: Callable[[], Any]) -> Any:
        """``request()``, retried with backoff while it fails transiently.

        Raises:
          StoreUnavailableError: still failing transiently at the deadline.
          DirectReadError: it failed otherwise.
        """
        started, retry = time.monotonic(), 0
        while True:
            try:
                return request()
            except _Transient as e:
                failure: BaseException = e
            except ConnectionRefusedError as e:
                # Nothing listens where this reader connects (TensorStore, which retries
                # the range with the same deadline, may reach the store another way).
                raise DirectReadError(f"{type(e).__name__}: {e}") from e
            except _TRANSIENT_ERRORS as e:
                failure = e
            except (OSError, http.client.HTTPException, ValueError) as e:
                raise DirectReadError(f"{type(e).__name__}: {e}") from e
            delay = self._backoff.delay(retry, started, unreachable=unreachable(failure))
            if delay is None:
                note = elapsed_note(retry + 1, started)
                raise StoreUnavailableError(f"{_describe(failure)}{note}") from failure
            retry += 1
            with self._lock:
                self.retries += 1
            time.sleep(delay)

    def read_into(self, name: str, offset: int, out: memoryview) -> int | None:
        """Reads ``len(out)`` bytes of object ``name`` from ``offset`` into ``out``.

        Returns:
          None if the object does not exist; else the bytes it had in the
          range, which is less than ``len(out)`` only if it is shorter.

        Raises:
          DirectReadError: anything else (a status other than 200/206/404/416,
            a broken connection, a timeout); ``out`` may hold part of the range.
        """
        path = self._object_path(name)
        try:
            got = self._retrying(lambda: self._get(path, offset, out))
        except StoreUnavailableError:
            raise  # the store's state, not this reader's: direct reads stay on
        except DirectReadError:
            self._failed()
            raise
        with self._lock:
            self._failures = 0
            self.reads += 1
        return got

    def age(self, name: str) -> float | None:
        """Seconds since object ``name`` was written: its modification time against the
        ``Date`` of the same response, both the store's clock. None if it does not
        exist or the store does not say.

        Raises:
          DirectReadError: the request failed (:class:`StoreUnavailableError`: it was
            throttled or failed transiently until the deadline).
        """
        if self._stat is None:
            return None
        try:
            return self._retrying(lambda: self._age(name))
        except (TypeError, KeyError) as e:
            raise DirectReadError(f"{type(e).__name__}: {e}") from e

    def _age(self, name: str) -> float | None:
        assert self._stat is not None
        path, stamps = self._stat
        conn, idle = self._take()
        reuse = False
        try:
            try:
                response = self._send(conn, path(name), {})
            except _STALE:
                if not idle:
                    raise
                conn.close()
                conn = self._connect()
                response = self._send(conn, path(name), {})
            body = response.read(1 << 16)
            reuse = response.isclosed()
            if response.status == 404:
                return None
            _check_status(response)
            written = stamps(response, body)
            now = response.getheader("Date")
            if written is None or not now:
                return None
            # Date has whole seconds (truncated), the modification time may not: never below 0.
            return max(0.0, email.utils.parsedate_to_datetime(now).timestamp() - written)
        finally:
            self._give(conn, reuse)

    def _send(
        self, conn: http.client.HTTPConnection, path: str, headers: dict[str, str]
    ) -> http.client.HTTPResponse:
        """Sends one signed GET and returns its response (``_STALE`` if an idle
        connection turned out closed)."""
        if self._authorize is not None:
            try:
                self._authorize(self.base_url + path, headers)
            except Exception as e:  # the clouds' credential errors share no base class
                raise DirectReadError(f"cannot authorize: {type(e).__name__}: {e}") from e
        conn.request("GET", self._target + path, headers=headers)
        return conn.getresponse()

    def _get(self, path: str, offset: int, out: memoryview) -> int | None:
        """One GET; sent again on a fresh connection if an idle one turns out closed."""
        headers = {"Range": f"bytes={offset}-{offset + len(out) - 1}"}
        conn, idle = self._take()
        reuse = False
        try:
            try:
                response = self._send(conn, path, headers)
            except _STALE:
                if not idle:
                    raise
                # The server closed the kept-alive connection while it was idle.
                conn.close()
                conn = self._connect()
                response = self._send(conn, path, {"Range": headers["Range"]})
            got, reuse = self._body(response, offset, out)
            return got
        finally:
            self._give(conn, reuse)

    def _body(
        self, response: http.client.HTTPResponse, offset: int, out: memoryview
    ) -> tuple[int | None, bool]:
        """``(bytes read or None, whether the connection can be reused)``."""
        status = response.status
        if status in (404, 416):  # missing; or the object ends before the range
            response.read()
            return (None if status == 404 else 0), True
        _check_status(response)
        if status == 200 and offset:
            raise DirectReadError(f"HTTP {status} {response.reason}")
        where = response.getheader("Content-Range", "")
        if status == 206 and not where.startswith(f"bytes {offset}-"):
            raise DirectReadError(f"asked for bytes from {offset}, got {where or 'no range'}")
        length = response.length  # None: no Content-Length (chunked)
        want = len(out) if length is None else min(len(out), length)
        got = 0
        while got < want:
            n = response.readinto(out[got:want])
            if not n:  # a connection cut short: sent again
                raise _Transient(f"the response ended after {got} of {want} bytes")
            got += n
        # Reused only once the body is read to its end (not so: a 200 longer than the range).
        return got, response.isclosed()

    def _take(self) -> tuple[http.client.HTTPConnection, bool]:
        """An idle connection (and True), else a new one (and False)."""
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's sockets are not ours
                self._idle, self._pid = [], os.getpid()
            if self._idle:
                return self._idle.pop(), True
        return self._connect(), False

    def _connect(self) -> http.client.HTTPConnection:
        if self._https:
            if self._tls is None:
                self._tls = ssl.create_default_context()
            return http.client.HTTPSConnection(
                self._host, self._port, timeout=self._timeout, context=self._tls
            )
        return http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)

    def _give(self, conn: http.client.HTTPConnection, reuse: bool) -> None:
        if not reuse:
            conn.close()
            return
        with self._lock:
            self._idle.append(conn)

    def _failed(self) -> None:
        with self._lock:
            self.failed += 1
            self._failures += 1
            if self._failures >= FAILURES_BEFORE_OFF and self.enabled:
                self.enabled = False
                _log.warning(
                    "%d direct reads from %s failed in a row; "
                    "reading through TensorStore from now on",
                    self._failures,
                    self.base_url,
                )

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def _check_status(response: http.client.HTTPResponse) -> None:
    """Raises unless the response is a 200 or 206: ``_Transient`` for a status worth
    retrying (throttling, 5xx, 408), else DirectReadError."""
    status = response.status
    if status in (200, 206):
        return
    text = f"HTTP {status} {response.reason}"
    if status in RETRY_HTTP_STATUSES:
        raise _Transient(text)
    raise DirectReadError(text)


def _describe(error: BaseException) -> str:
    return str(error) if isinstance(error, DirectReadError) else f"{type(error).__name__}: {error}"
