"""The direct readers (:class:`~jaxckpt.storage._http.DirectReader`) of S3 and GCS
buckets: each cloud's addressing, ``Last-Modified`` stamps and request signing.

Requests are signed with the well-kept client libraries of each cloud: botocore's
credential chain and SigV4 signer for S3 (``jaxckpt[s3]``), google-auth's
application-default credentials for GCS (``jaxckpt[gcs]``). Without them, or with an
HTTPS endpoint behind a proxy in the environment (which TensorStore's libcurl honours
and the direct reader does not), there is no direct reader and restores read through
TensorStore; a plain-HTTP endpoint behind a plain-HTTP proxy is read through the proxy.
"""

from __future__ import annotations

import datetime
import email.utils
import http.client
import json
import logging
import threading
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

from jaxckpt.storage._http import DirectReader
from jaxckpt.storage._retry import Backoff
from jaxckpt.storage._s3address import AddressingStyle, S3Address

__all__ = ["gcs_reader", "s3_reader"]

_log = logging.getLogger(__name__)

_GCS_READ_SCOPE = "https://www.googleapis.com/auth/devstorage.read_only"
_GCS_PUBLIC = "https://storage.googleapis.com"


def _once(resolve: Callable[[], Any]) -> Callable[[], Any]:
    """``resolve()``, called on the first use only (credentials: None means anonymous)."""
    lock = threading.Lock()
    value: list[Any] = []

    def get() -> Any:
        with lock:
            if not value:
                value.append(resolve())
            return value[0]

    return get


def _proxy(url: str) -> str | None:
    """The proxy the environment sends requests to ``url`` through (``http://HOST:PORT``),
    '' when it does so through one the direct reader cannot use, None when directly.

    A plain-HTTP URL through a plain-HTTP proxy is read with absolute-form requests
    (what libcurl, and so TensorStore, sends); HTTPS through a proxy is left to
    TensorStore.
    """
    parts = urllib.parse.urlsplit(url)
    proxies = urllib.request.getproxies()
    if parts.scheme not in proxies or urllib.request.proxy_bypass(parts.netloc):
        return None
    proxy = urllib.parse.urlsplit(proxies[parts.scheme])
    usable = parts.scheme == proxy.scheme == "http" and proxy.hostname and not proxy.username
    return f"http://{proxy.netloc}" if usable else ""


def s3_reader(
    bucket: str,
    region: str,
    endpoint: str | None,
    timeout_s: float | None,
    backoff: Backoff | None = None,
    *,
    style: AddressingStyle = "auto",
) -> DirectReader | None:
    """A reader of an S3 bucket, or None (botocore missing, or a proxy in the way).

    Requests are signed with SigV4 by botocore, with credentials from its
    default chain (environment, shared files, SSO, web identity, instance
    metadata), resolved on the first read; without credentials they are
    anonymous. The bucket is addressed as :class:`S3Address` says for ``style``
    (what TensorStore and botocore do too): by default path-style with a custom
    ``endpoint`` (``endpoint/bucket/key``), and on AWS virtual-hosted when the
    bucket name allows it.
    """
    try:
        import botocore.auth
        import botocore.awsrequest
        import botocore.session
    except ImportError:
        _log.debug("botocore is not installed: s3:// restores read through TensorStore")
        return None
    address = S3Address(bucket=bucket, region=region, endpoint=endpoint, style=style)
    base, prefix = address.base_url, address.object_prefix
    proxy = _proxy(base)
    if proxy == "":
        return None
    resolved = _once(lambda: botocore.session.get_session().get_credentials())

    def authorize(url: str, headers: dict[str, str]) -> None:
        credentials = resolved()
        if credentials is None:
            return
        request = botocore.awsrequest.AWSRequest("GET", url, headers=headers)
        frozen = credentials.get_frozen_credentials()
        botocore.auth.S3SigV4Auth(frozen, "s3", region).add_auth(request)
        headers.update(request.headers.items())

    def object_path(name: str) -> str:
        return prefix + urllib.parse.quote(name, safe="/~")

    def stamps(response: http.client.HTTPResponse, body: bytes) -> float | None:
        modified = response.getheader("Last-Modified")
        return email.utils.parsedate_to_datetime(modified).timestamp() if modified else None

    stat = (object_path, stamps)
    return DirectReader(base, object_path, authorize, timeout_s, stat, backoff, proxy=proxy)


def gcs_reader(
    bucket: str, endpoint: str | None, timeout_s: float | None, backoff: Backoff | None = None
) -> DirectReader | None:
    """A reader of a GCS bucket (JSON API media downloads), or None.

    Over HTTPS, requests carry google-auth's application-default credentials
    (read-only scope), resolved on the first read and refreshed on demand;
    without credentials they are anonymous, as TensorStore's are. Over plain
    HTTP (an emulator, e.g. ``STORAGE_EMULATOR_HOST``) they are anonymous: a
    bearer token is never sent unencrypted. None if google-auth (or its
    ``requests`` transport) is missing for an HTTPS endpoint, or a proxy is in
    the way.
    """
    base = (endpoint or _GCS_PUBLIC).rstrip("/")
    proxy = _proxy(base)
    if proxy == "":
        return None
    quoted_bucket = urllib.parse.quote(bucket, safe="")

    def metadata_path(name: str) -> str:
        return f"/storage/v1/b/{quoted_bucket}/o/{urllib.parse.quote(name, safe='')}"

    def object_path(name: str) -> str:
        return metadata_path(name) + "?alt=media"

    def stamps(response: http.client.HTTPResponse, body: bytes) -> float | None:
        updated = json.loads(body).get("updated")
        return datetime.datetime.fromisoformat(updated).timestamp() if updated else None

    stat = (metadata_path, stamps)
    if base.startswith("http://"):
        return DirectReader(base, object_path, None, timeout_s, stat, backoff, proxy=proxy)
    try:
        import google.auth
        import google.auth.exceptions
        import google.auth.transport.requests
    except ImportError:
        _log.debug("google-auth is not installed: gs:// restores read through TensorStore")
        return None

    def application_default() -> Any:
        try:
            return google.auth.default(scopes=[_GCS_READ_SCOPE])[0]
        except google.auth.exceptions.DefaultCredentialsError:
            return None

    resolved = _once(application_default)
    refreshing = threading.Lock()  # one refresh at a time; apply reads the fresh token

    def authorize(url: str, headers: dict[str, str]) -> None:
        credentials = resolved()
        if credentials is None:
            return
        with refreshing:
            if not credentials.valid:
                credentials.refresh(google.auth.transport.requests.Request())
            credentials.apply(headers)

    return DirectReader(base, object_path, authorize, timeout_s, stat, backoff, proxy=proxy)
