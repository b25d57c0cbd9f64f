"""Create-only PUTs to S3 that the store decides (``If-None-Match: *``), and batched
deletes (``DeleteObjects``), through botocore.

TensorStore's s3 driver checks a create-only write's condition with a HEAD
before its PUT: two round trips, and two writers racing between them can both
create the key. S3 decides ``PutObject`` with ``If-None-Match: *`` itself, in
one request (AWS since 2024; MinIO and moto honour it too). With botocore
installed (``jaxckpt[s3]``, which also signs the direct reads), the commit
markers, epoch records and every other create-only record go this way;
without it, or without credentials, through TensorStore. The same client deletes up
to 1,000 keys per ``DeleteObjects`` request (a retired step's packs, records and
chunks), where TensorStore would send one request per object.

botocore's own retries are off (its standard mode's retry quota stops retrying
after a burst of failures, exactly when a store throttles): every call here
retries throttling and transient failures itself, with the root's
:class:`~jaxckpt.storage._retry.Backoff` (full jitter, bounded by the deadline).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from jaxckpt.storage._retry import RETRY_HTTP_STATUSES, Backoff, elapsed_note, unreachable
from jaxckpt.storage._s3address import S3Address

_log = logging.getLogger(__name__)

CREATED, EXISTS, CONFLICT = "created", "exists", "conflict"
"""What :meth:`S3Creates.create` found: the key was created; it exists (412);
another conditional write of the key was in flight (409: try again)."""


_T = TypeVar("_T")
DELETE_BATCH = 1000
"""Keys per ``DeleteObjects`` request (S3's limit)."""
_RETRY_CODES = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError",
     "ServiceUnavailable", "RequestLimitExceeded", "TooManyRequests"}
)  # fmt: skip
"""S3 error codes that say "not now" (in a response, or per key of a DeleteObjects)."""


class DeleteRefusedError(Exception):
    """S3 refused to delete a key (not a transient error); ``key`` names it."""

    def __init__(self, key: str, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.key = key


def transient(error: BaseException) -> bool:
    """Whether a botocore error is throttling, a 5xx, a timeout or a dropped connection."""
    import botocore.exceptions

    if isinstance(error, botocore.exceptions.HTTPClientError | botocore.exceptions.ConnectionError):
        return True
    if isinstance(error, botocore.exceptions.ClientError):
        meta = error.response.get("ResponseMetadata", {})
        code = error.response.get("Error", {}).get("Code")
        return meta.get("HTTPStatusCode") in RETRY_HTTP_STATUSES or code in _RETRY_CODES
    return False


_clients_lock = threading.Lock()
_clients: dict[tuple[str, str | None, str | None, float], Any] = {}
"""botocore clients (thread-safe), shared by every bucket with the same settings."""
os.register_at_fork(after_in_child=_clients.clear)  # a child opens its own connections


def _make_client(region: str, endpoint: str | None, style: str | None, timeout_s: float) -> Any:
    import botocore.config
    import botocore.handlers
    import botocore.session

    config = botocore.config.Config(
        connect_timeout=timeout_s,
        read_timeout=timeout_s,
        retries={"total_max_attempts": 1, "mode": "standard"},  # retried by S3Creates
        s3={"addressing_style": style} if style else None,
        request_checksum_calculation="when_required",
    )
    client = botocore.session.get_session().create_client(
        "s3", region_name=region, endpoint_url=endpoint, config=config
    )
    # botocore asks for "100 Continue" before every PUT body: a round trip more, for
    # records of a few hundred bytes.
    client.meta.events.unregister("before-call.s3", botocore.handlers.add_expect_header)
    return client


class S3Creates:
    """Create-only PUTs and batched deletes in one bucket over botocore's client (made on
    first use).

    Args:
      address: the bucket, its region (SigV4 signs with it), an S3-compatible endpoint
        (or None for AWS) and the addressing style.
      timeout_s: connect and read timeout of one request.
      backoff: when to retry a request that failed transiently, and when to give up.
    """

    def __init__(self, address: S3Address, timeout_s: float, backoff: Backoff) -> None:
        self._bucket = address.bucket
        self._client_key = (address.region, address.endpoint, address.botocore_style(), timeout_s)
        self._backoff = backoff

    def _retrying(self, call: Callable[[], _T]) -> _T:
        """``call()``, retried while it fails transiently (until the backoff gives up)."""
        started, retry = time.monotonic(), 0
        while True:
            try:
                return call()
            except Exception as e:
                if not transient(e):
                    raise
                delay = self._backoff.delay(retry, started, unreachable=unreachable(e))
                if delay is None:
                    e.add_note(elapsed_note(retry + 1, started))
                    raise
                retry += 1
                _log.debug("S3 request failed (%s); retry %d in %.2f s", e, retry, delay)
                time.sleep(delay)

    def _get_client(self) -> Any:
        key = self._client_key
        with _clients_lock:
            if key not in _clients:  # ~0.1 s of CPU each: one per configuration and process
                _clients[key] = _make_client(*key)
            return _clients[key]

    def create(self, name: str, data: bytes) -> str:
        """PUTs ``data`` as ``name`` unless it exists: :data:`CREATED`, :data:`EXISTS` or
        :data:`CONFLICT`.

        Raises:
          botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError: the request
            failed otherwise (the caller names the key).
        """
        import botocore.exceptions

        client = self._get_client()
        try:
            self._retrying(
                lambda: client.put_object(Bucket=self._bucket, Key=name, Body=data, IfNoneMatch="*")
            )
        except botocore.exceptions.ClientError as e:
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status == 412:  # PreconditionFailed: the key exists
                return EXISTS
            if status == 409:
                return CONFLICT
            raise
        return CREATED

    def delete(self, names: Sequence[str]) -> None:
        """Deletes the objects ``names`` (missing ones are not errors), 1,000 per request.

        Keys a response reports as throttled or failed transiently are sent again in
        the next request, within the same deadline.

        Raises:
          DeleteRefusedError: S3 refused a key for good (e.g. ``AccessDenied``).
          botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError: a
            request failed otherwise.
        """
        client = self._get_client()
        for i in range(0, len(names), DELETE_BATCH):
            batch = list(names[i : i + DELETE_BATCH])
            started, retry = time.monotonic(), 0
            while batch:
                request = {"Objects": [{"Key": name} for name in batch], "Quiet": True}
                response = self._retrying(
                    functools.partial(client.delete_objects, Bucket=self._bucket, Delete=request)
                )
                batch = []
                for error in response.get("Errors", []):
                    code, key = error.get("Code", ""), error.get("Key", "")
                    if code not in _RETRY_CODES:
                        raise DeleteRefusedError(key, code, error.get("Message", ""))
                    batch.append(key)
                if batch:
                    delay = self._backoff.delay(retry, started)
                    if delay is None:
                        note = elapsed_note(retry + 1, started)
                        raise DeleteRefusedError(
                            batch[0], "SlowDown", f"keys still throttled{note}"
                        )
                    retry += 1
                    time.sleep(delay)


def s3_creates(address: S3Address, timeout_s: float, backoff: Backoff) -> S3Creates | None:
    """An :class:`S3Creates`, or None when botocore is missing or finds no credentials."""
    try:
        import botocore.session
    except ImportError:
        _log.debug("botocore is not installed: create-only writes go through TensorStore")
        return None
    if botocore.session.get_session().get_credentials() is None:
        _log.debug("botocore finds no credentials: create-only writes go through TensorStore")
        return None
    return S3Creates(address, timeout_s, backoff)


def refuses_condition(error: BaseException) -> bool:
    """Whether ``error`` says the store (400, 501) or this botocore (no ``IfNoneMatch``
    parameter) cannot send ``If-None-Match``: create-only writes then go through TensorStore."""
    import botocore.exceptions

    if isinstance(error, botocore.exceptions.ParamValidationError):
        return True
    response = getattr(error, "response", None)
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") if response else None
    return status in (400, 501)
