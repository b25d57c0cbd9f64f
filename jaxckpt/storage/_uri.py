"""Root URIs: what a checkpoint root may be called, checked and normalised in one place.

A root is a local path (``~`` expanded, made absolute), a ``file://`` URI (the
same, after the scheme; ``file:/abs/path`` and ``file:///abs/path`` both mean
``/abs/path``), or ``gs://BUCKET[/PREFIX]`` / ``s3://BUCKET[/PREFIX]``. A cloud
scheme with one slash or none (``gs:/bucket``, ``s3:bucket``) is a typo, refused
with the spelling that works: taken as a path it would checkpoint into
``./gs:/bucket`` on local disk. So is an upper-case scheme (``S3://``, ``GS://``).
An object-store root must stay inside its bucket and prefix: the prefix is
split on ``/`` and every segment must be non-empty and neither ``.`` nor
``..`` (HTTP clients normalise dot segments in request paths, not in listings,
so ``s3://home/../victim/run`` would write into bucket ``victim``); trailing
slashes are dropped. Bucket names follow the clouds' rules. Anything else
(another scheme, an empty bucket, control characters) is refused with a
:class:`jaxckpt.StorageError` naming the root, before any request is sent.

>>> parse_root("s3://bucket/runs/a/").uri
's3://bucket/runs/a'
>>> parse_root("gs://bucket").prefix
''
>>> parse_root("s3://home/../victim/run")
Traceback (most recent call last):
...
jaxckpt.errors.StorageError: [Errno 22] invalid checkpoint root 's3://home/../victim/run': \
the prefix may not contain '..' segments
>>> parse_root("gs:/bucket/run")
Traceback (most recent call last):
...
jaxckpt.errors.StorageError: [Errno 22] invalid checkpoint root 'gs:/bucket/run': \
'gs:' needs two slashes after it: use 'gs://bucket/run'
>>> parse_root("S3://bucket/run")
Traceback (most recent call last):
...
jaxckpt.errors.StorageError: [Errno 22] invalid checkpoint root 'S3://bucket/run': \
the scheme is lower case: use 's3://bucket/run'
>>> parse_root("file:/tmp/run").uri
'/tmp/run'
"""

from __future__ import annotations

import dataclasses
import errno
import os
import re

from jaxckpt.errors import StorageError

OBJECT_SCHEMES = ("gs", "s3")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# S3: 3-63 characters, lowercase letters, digits, dots and hyphens.
_S3_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
# GCS: the same plus underscores; up to 222 characters when dotted, 63 per component.
_GCS_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")
_IP_ADDRESS = re.compile(r"^\d+\.\d+\.\d+\.\d+$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# A known scheme with fewer than two slashes after its colon ("gs:/b", "s3:b", "file:/p").
_SHORT_SCHEME = re.compile(r"^(gs|s3|gcs|file):(?!//)(/?)", re.IGNORECASE)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RootURI:
    """A checked, normalised root.

    Attributes:
      scheme: ``"file"`` for local roots, else ``"gs"`` or ``"s3"``.
      path: the absolute local path ('' for object stores).
      bucket: the bucket ('' for local roots).
      prefix: the object-name prefix, without leading or trailing ``/``.
    """

    scheme: str
    path: str = ""
    bucket: str = ""
    prefix: str = ""

    @property
    def uri(self) -> str:
        """The normalised root: the absolute path, or ``scheme://bucket[/prefix]``."""
        if self.scheme == "file":
            return self.path
        base = f"{self.scheme}://{self.bucket}"
        return f"{base}/{self.prefix}" if self.prefix else base


def _invalid(text: str, why: str) -> StorageError:
    return StorageError(errno.EINVAL, f"invalid checkpoint root {text!r}: {why}")


def parse_root(root: str | os.PathLike[str]) -> RootURI:
    """Checks and normalises a root URI or path.

    Raises:
      StorageError: (``EINVAL``) the root is empty, has another scheme, names
        no valid bucket, or has a prefix that could leave it.
    """
    text = os.fspath(root)
    if not isinstance(text, str):
        raise _invalid(repr(text), "a root is a str or os.PathLike of str")
    if not text:
        raise StorageError(errno.EINVAL, "checkpoint root is empty")
    if _CONTROL.search(text):
        raise _invalid(text, "it contains control characters")
    if text.startswith("file://"):
        return _local(text, text[len("file://") :])
    short = _SHORT_SCHEME.match(text)
    if short is not None:
        return _short_scheme(text, short)
    match = _SCHEME.match(text)
    if match is None:
        return _local(text, text)
    scheme = match.group(1).lower()
    if scheme not in OBJECT_SCHEMES:
        raise _invalid(text, "use a path, file://, gs://BUCKET/PREFIX or s3://BUCKET/PREFIX")
    if match.group(1) != scheme:  # other tools read S3:// differently, or not at all
        raise _invalid(text, f"the scheme is lower case: use {scheme + text[len(scheme) :]!r}")
    bucket, _, prefix = text[match.end() :].partition("/")
    _check_bucket(text, scheme, bucket)
    return RootURI(scheme=scheme, bucket=bucket, prefix=_check_prefix(text, prefix))


def _short_scheme(text: str, match: re.Match[str]) -> RootURI:
    """``file:/abs/path`` is ``/abs/path``; anything else with one slash or none is refused."""
    scheme, rest = match.group(1).lower(), text[match.end() :]
    if scheme == "file":
        if not match.group(2):
            raise _invalid(text, "use file:///ABSOLUTE/PATH, file:/ABSOLUTE/PATH or a plain path")
        return _local(text, "/" + rest)
    fixed = f"{'gs' if scheme == 'gcs' else scheme}://{rest}"
    raise _invalid(text, f"'{match.group(1)}:' needs two slashes after it: use {fixed!r}")


def _local(text: str, path: str) -> RootURI:
    if not path:
        raise _invalid(text, "the path is empty")
    return RootURI(scheme="file", path=os.path.abspath(os.path.expanduser(path)))


def _check_bucket(text: str, scheme: str, bucket: str) -> None:
    if not bucket:
        raise _invalid(text, f"no bucket: use {scheme}://BUCKET/PREFIX")
    rule = _S3_BUCKET if scheme == "s3" else _GCS_BUCKET
    bad = (
        not rule.match(bucket)
        or ".." in bucket
        or _IP_ADDRESS.match(bucket)
        or any(len(part) > 63 for part in bucket.split("."))
    )
    if bad:
        allowed = "dots, hyphens" if scheme == "s3" else "dots, hyphens, underscores"
        raise _invalid(
            text,
            f"bucket {bucket!r} is not a valid {scheme} bucket name (3-63 lowercase letters, "
            f"digits, {allowed}; starting and ending with a letter or digit)",
        )


def _check_prefix(text: str, prefix: str) -> str:
    prefix = prefix.rstrip("/")
    if not prefix:
        return ""
    for segment in prefix.split("/"):
        if segment in (".", ".."):
            raise _invalid(text, f"the prefix may not contain {segment!r} segments")
        if not segment:
            raise _invalid(text, "the prefix may not contain empty segments ('//')")
    return prefix
