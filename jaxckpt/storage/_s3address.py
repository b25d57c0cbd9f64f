"""Where an S3 bucket's requests go: path-style or virtual-hosted URLs, one answer for
every client (TensorStore's ``s3`` kvstore, botocore, the direct reader).

Path-style puts the bucket in the path (``ENDPOINT/BUCKET/KEY``), virtual-hosted in the
host name (``BUCKET.HOST/KEY``). ``"auto"`` is what the clients did before the option
existed: path-style with a custom endpoint (MinIO, moto), and on AWS virtual-hosted
when the bucket name is a DNS label (no dots), else path-style. ``"virtual"`` with a
custom endpoint serves stores that accept nothing else (CoreWeave); TensorStore (0.1.82
and later) reaches them through a spec with an empty ``bucket`` and the bucket's own
endpoint, which it uses as the base URL of every request.

>>> a = S3Address(bucket="b", region="us-east-1", endpoint="https://cwobject.com", style="virtual")
>>> a.base_url, a.object_prefix, a.tensorstore_members()["endpoint"]
('https://b.cwobject.com', '/', 'https://b.cwobject.com')
>>> S3Address(bucket="b", region="eu-west-1", endpoint=None, style="path").base_url
'https://s3.eu-west-1.amazonaws.com'
"""

from __future__ import annotations

import dataclasses
import errno
import os
import re
import urllib.parse
from typing import Any, Literal

from jaxckpt.errors import StorageError

__all__ = ["ADDRESSING_ENV", "ADDRESSING_STYLES", "AddressingStyle", "S3Address"]

AddressingStyle = Literal["auto", "path", "virtual"]
ADDRESSING_STYLES: tuple[AddressingStyle, ...] = ("auto", "path", "virtual")
ADDRESSING_ENV = "JAXCKPT_S3_ADDRESSING_STYLE"
"""Read when ``ObjectStoreOptions.addressing_style`` is ``"auto"`` (roots opened by the CLI)."""
_DNS_BUCKET = re.compile(r"^[a-z0-9][a-z0-9-]{1,61}[a-z0-9]$")
_IP_HOST = re.compile(r"^(\d+\.\d+\.\d+\.\d+|\[[0-9a-fA-F:.]+\])$")


def resolve_style(style: AddressingStyle, uri: str) -> AddressingStyle:
    """``style``, or for ``"auto"`` the environment's :data:`ADDRESSING_ENV` if set.

    Raises:
      StorageError: (``EINVAL``) the environment names no style; the message names ``uri``.
    """
    if style != "auto":
        return style
    text = os.environ.get(ADDRESSING_ENV, "").strip().lower() or "auto"
    if text not in ADDRESSING_STYLES:
        raise StorageError(
            errno.EINVAL,
            f"cannot open {uri}: {ADDRESSING_ENV}={os.environ[ADDRESSING_ENV]!r} is not one of "
            f"{', '.join(ADDRESSING_STYLES)}",
        )
    return text


@dataclasses.dataclass(frozen=True, kw_only=True)
class S3Address:
    """The addressing of one bucket.

    Attributes:
      bucket: the bucket.
      region: its region (AWS host names carry it).
      endpoint: a custom endpoint (``scheme://host[:port][/path]``), or None for AWS.
      style: ``"auto"``, ``"path"`` or ``"virtual"`` (see the module docstring).
    """

    bucket: str
    region: str
    endpoint: str | None
    style: AddressingStyle = "auto"

    def __post_init__(self) -> None:
        if self.virtual and self.endpoint:
            host = urllib.parse.urlsplit(self.endpoint).hostname or ""
            if _IP_HOST.match(host) or host == "localhost":
                raise StorageError(
                    errno.EINVAL,
                    f"cannot address s3://{self.bucket} virtual-hosted at {self.endpoint}: "
                    f"{host} cannot carry a bucket name; use a host name or path-style "
                    f"addressing",
                )

    @property
    def virtual(self) -> bool:
        """Whether the bucket is in the host name."""
        if self.style == "auto":
            return not self.endpoint and bool(_DNS_BUCKET.match(self.bucket))
        return self.style == "virtual"

    def _parts(self) -> urllib.parse.SplitResult:
        if self.endpoint:
            return urllib.parse.urlsplit(self.endpoint.rstrip("/"))
        host = f"s3.{self.region}.amazonaws.com"
        return urllib.parse.SplitResult("https", host, "", "", "")

    @property
    def base_url(self) -> str:
        """``scheme://host[:port]`` of every request."""
        parts = self._parts()
        host = f"{self.bucket}.{parts.netloc}" if self.virtual else parts.netloc
        return f"{parts.scheme}://{host}"

    @property
    def object_prefix(self) -> str:
        """The request path of every object starts with this (ends with ``/``)."""
        path = self._parts().path
        return f"{path}/" if self.virtual else f"{path}/{self.bucket}/"

    def botocore_style(self) -> str | None:
        """botocore's ``s3.addressing_style`` (None: its own choice, AWS's ``"auto"``)."""
        if self.style == "auto":
            return "path" if self.endpoint else None
        return self.style

    def tensorstore_members(self) -> dict[str, Any]:
        """Members of TensorStore's ``s3`` kvstore spec: ``bucket``, ``aws_region`` and,
        unless TensorStore's own choice is the same, ``endpoint``."""
        members: dict[str, Any] = {"bucket": self.bucket, "aws_region": self.region}
        if self.style == "virtual":
            # An empty bucket: TensorStore uses the endpoint as each request's base URL.
            members.update(bucket="", endpoint=self.base_url + self.object_prefix.rstrip("/"))
        elif self.endpoint or self.style == "path":
            members["endpoint"] = (self.endpoint or self.base_url).rstrip("/")
        return members
