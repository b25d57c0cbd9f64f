"""TensorStore's process-wide HTTP settings: the GCS endpoint, stall limits, S3 credentials.

TensorStore reads these from the environment (or its context), once per process
or per driver, so every root a process opens shares them.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import Any

_log = logging.getLogger(__name__)

_GCS_URL_ENV = "TENSORSTORE_GCS_HTTP_URL"
# libcurl's stall detection in TensorStore's HTTP transport (process-wide, read
# when the transport is created): a request that moves less than one byte per
# second for this many seconds fails (and is retried), as does a connect.
_CURL_STALL_ENV = (
    "TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS",
    "TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS",
)
_CURL_SPEED_ENV = "TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES"
_CURL_MARKER_ENV = "JAXCKPT_CURL_LIMITS_PID"


_TOKEN_ENV = "GOOGLE_AUTH_TOKEN_FOR_TESTING"
PLAIN_HTTP_TOKEN = "jaxckpt-anonymous"
"""The placeholder bearer token TensorStore sends to a plain-HTTP GCS endpoint (an emulator)."""


def resolve_gcs_endpoint(explicit: str | None) -> str | None:
    """Points TensorStore's GCS driver at ``explicit`` or ``STORAGE_EMULATOR_HOST``.

    A plain-HTTP endpoint (an emulator) gets no real credentials, as Google's client
    libraries do with ``STORAGE_EMULATOR_HOST`` and as the direct reads do: TensorStore
    has no anonymous mode, so its fixed-token provider (``GOOGLE_AUTH_TOKEN_FOR_TESTING``,
    read once per process on its first GCS request) is given a placeholder, and a real
    token never travels unencrypted. A token the user set is kept. (Without it,
    TensorStore also probes for a metadata server before its first request.)
    """
    endpoint = explicit
    if endpoint is None:
        host = os.environ.get("STORAGE_EMULATOR_HOST")
        if host:
            endpoint = host if "://" in host else f"http://{host}"
    if endpoint is None:
        endpoint = os.environ.get(_GCS_URL_ENV) or None
        if endpoint is not None and endpoint.startswith("http://"):
            os.environ.setdefault(_TOKEN_ENV, PLAIN_HTTP_TOKEN)
        return endpoint
    endpoint = endpoint.rstrip("/")
    if endpoint.startswith("http://"):
        os.environ.setdefault(_TOKEN_ENV, PLAIN_HTTP_TOKEN)
    current = os.environ.get(_GCS_URL_ENV)
    if current != endpoint:
        if current:
            _log.warning(
                "redirecting every TensorStore GCS request in this process from %s to %s",
                current,
                endpoint,
            )
        os.environ[_GCS_URL_ENV] = endpoint
    return endpoint


_AUTH_LINE = b"google_auth_provider.cc"
_S3_AUTH_LINES = (b"AuthCredentialsProvider", b"common-io", b"AWSProfile")
"""The AWS SDK's lines (inside TensorStore's S3 driver) while its default chain looks for
credentials: a missing ~/.aws file or environment variable is an error line each."""
_primed = threading.Lock()
_primed_pid: list[int] = []
_primed_s3: list[int] = []


def quiet_s3_auth(first_request: Callable[[], object]) -> None:
    """:func:`quiet_gcs_auth` for TensorStore's S3 driver: its first request, whose
    credential lookup logs a line per place it looked, runs with stderr filtered."""
    _quiet(first_request, _primed_s3, _S3_AUTH_LINES)


def quiet_gcs_auth(first_request: Callable[[], object]) -> None:
    """Runs this process's first TensorStore GCS request with stderr (fd 2) captured,
    and writes back everything but TensorStore's credential lookup lines.

    TensorStore picks its GCS credentials once per process, on the first request, and
    logs the choice on stderr from C++: ``Using GOOGLE_AUTH_TOKEN_FOR_TESTING`` with an
    emulator, ``Could not find the credentials file ...`` with no credentials at all.
    Neither says anything to a ``jaxckpt`` user, and neither its context nor its
    flags turn them off (tensorstore 0.1.86), so they are taken out at the source: the
    lookup runs here, once, and other output of that moment is kept, only delayed.
    Failures of the request are left to the caller's own request.
    """
    _quiet(first_request, _primed_pid, (_AUTH_LINE,))


def _quiet(first_request: Callable[[], object], primed: list[int], drop: tuple[bytes, ...]) -> None:
    with _primed:
        if primed == [os.getpid()]:
            return
        primed[:] = [os.getpid()]
        sys.stderr.flush()
        with tempfile.TemporaryFile() as captured:
            saved = os.dup(2)
            os.dup2(captured.fileno(), 2)
            try:
                first_request()
            except Exception as e:  # reported by the caller's own request
                _log.debug("first request failed: %s", e)
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                os.close(saved)
            captured.seek(0)
            lines = captured.read().splitlines(keepends=True)
        kept = b"".join(line for line in lines if not any(d in line for d in drop))
        if kept:
            os.write(2, kept)


def bound_stalls(timeout_s: float | None) -> None:
    """Makes TensorStore's HTTP requests fail after ``timeout_s`` without progress.

    TensorStore has no per-request deadline in its context; its libcurl
    transport takes stall limits from the environment when it is created
    (the process's first HTTP request), so the first root a process opens
    sets them. Limits the user set are kept. Limits that came from a parent
    process (marked with its pid in ``JAXCKPT_CURL_LIMITS_PID``) are not the
    user's: a child sets its own.
    """
    if timeout_s is None:
        return
    marker = os.environ.get(_CURL_MARKER_ENV)
    if marker == str(os.getpid()):
        return  # set by this process already: its transport has them
    users = marker is None and any(
        name in os.environ for name in (*_CURL_STALL_ENV, _CURL_SPEED_ENV)
    )
    if users:
        return
    seconds = str(max(1, math.ceil(timeout_s)))
    os.environ.update(dict.fromkeys(_CURL_STALL_ENV, seconds))
    os.environ[_CURL_SPEED_ENV] = "1"
    os.environ[_CURL_MARKER_ENV] = str(os.getpid())


def aws_credentials() -> dict[str, Any]:
    """TensorStore's S3 credential source (a context resource): the environment's keys
    when it has them.

    The AWS SDK's default chain finds environment keys first anyway, but it
    opens ``~/.aws/config`` and ``~/.aws/credentials`` beforehand and logs an
    error line for each missing file, on every command.
    """
    if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        return {"aws_credentials": {"type": "environment"}}
    return {}
