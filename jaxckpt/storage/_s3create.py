"""Create-only PUTs to S3 that the store decides (``If-None-Match: *``), through botocore.

TensorStore's s3 driver checks a create-only write's condition with a HEAD
before its PUT: two round trips, and two writers racing between them can both
create the key. S3 decides ``PutObject`` with ``If-None-Match: *`` itself, in
one request (AWS since 2024; MinIO and moto honour it too). With botocore
installed (``jaxckpt[s3]``, which also signs the direct reads), the commit
markers, epoch records and every other create-only record go this way;
without it, or without credentials, through TensorStore.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

_log = logging.getLogger(__name__)

CREATED, EXISTS, CONFLICT = "created", "exists", "conflict"
"""What :meth:`S3Creates.create` found: the key was created; it exists (412);
another conditional write of the key was in flight (409: try again)."""


_clients_lock = threading.Lock()
_clients: dict[tuple[str, str | None, float, int], Any] = {}
"""botocore clients (thread-safe), shared by every bucket with the same settings."""
os.register_at_fork(after_in_child=_clients.clear)  # a child opens its own connections


def _make_client(region: str, endpoint: str | None, timeout_s: float, attempts: int) -> Any:
    import botocore.config
    import botocore.handlers
    import botocore.session

    config = botocore.config.Config(
        connect_timeout=timeout_s,
        read_timeout=timeout_s,
        retries={"max_attempts": attempts, "mode": "standard"},
        s3={"addressing_style": "path"} if endpoint else None,
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
    """Create-only PUTs to one bucket over botocore's client (made on first use).

    Args:
      bucket: the bucket.
      region: its region (SigV4 signs with it).
      endpoint: an S3-compatible endpoint (path-style addressing), or None for AWS.
      timeout_s: connect and read timeout of one request.
      attempts: requests per call, retries of transient errors included.
    """

    def __init__(
        self, bucket: str, region: str, endpoint: str | None, timeout_s: float, attempts: int
    ) -> None:
        self._bucket = bucket
        self._region = region
        self._endpoint = endpoint
        self._timeout_s = timeout_s
        self._attempts = max(1, attempts)

    def _get_client(self) -> Any:
        key = (self._region, self._endpoint, self._timeout_s, self._attempts)
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
            client.put_object(Bucket=self._bucket, Key=name, Body=data, IfNoneMatch="*")
        except botocore.exceptions.ClientError as e:
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status == 412:  # PreconditionFailed: the key exists
                return EXISTS
            if status == 409:
                return CONFLICT
            raise
        return CREATED


def s3_creates(
    bucket: str, region: str, endpoint: str | None, timeout_s: float, attempts: int
) -> S3Creates | None:
    """An :class:`S3Creates`, or None when botocore is missing or finds no credentials."""
    try:
        import botocore.session
    except ImportError:
        _log.debug("botocore is not installed: create-only writes go through TensorStore")
        return None
    if botocore.session.get_session().get_credentials() is None:
        _log.debug("botocore finds no credentials: create-only writes go through TensorStore")
        return None
    return S3Creates(bucket, region, endpoint, timeout_s, attempts)


def refuses_condition(error: BaseException) -> bool:
    """Whether ``error`` says the store (400, 501) or this botocore (no ``IfNoneMatch``
    parameter) cannot send ``If-None-Match``: create-only writes then go through TensorStore."""
    import botocore.exceptions

    if isinstance(error, botocore.exceptions.ParamValidationError):
        return True
    response = getattr(error, "response", None)
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") if response else None
    return status in (400, 501)
