"""Checkpoint roots: one interface (:class:`Storage`), one backend per kind of store.

The factory :func:`open_storage` is the only place a backend is chosen, through
the table :data:`BACKENDS` (scheme -> opener), and the only importer of the
backends; the object-store backends (TensorStore, HTTP clients) are imported only
when a ``gs://`` or ``s3://`` root is opened, so listing a local root stays light.
Every root goes through :func:`~jaxckpt.storage._uri.parse_root` first, before
anything is sent or written.

Modules, bottom up: ``_base`` (the interface, :class:`PreconditionFailed`),
``_buffers`` (aligned buffers, ``pread``), ``_uri`` (root names), ``_options``
(:class:`ObjectStoreOptions`), ``_retry`` (deadline-bounded full-jitter
retries), ``_upload`` (local files stored in bounded parts: ``_s3upload``'s
multipart and ``_gcsupload``'s resumable uploads), ``_local`` (POSIX roots),
``_http`` (direct ranged GETs) and
``_cloudreads`` (their addressing and signing per cloud), ``_ranged`` (reads under
a memory budget), the object-store base in three layers (``_objrequests``: kvstore,
names, errors, retries; ``_objcreate``: create-only writes; ``_object``: the
``Storage`` operations), ``_s3`` and ``_gcs`` (one class per cloud). Nothing here
imports jaxckpt beyond this package, ``jaxckpt.errors`` and ``jaxckpt._pools``.

>>> import tempfile
>>> storage = open_storage(tempfile.mkdtemp())
>>> storage.write("a/b.json", b"{}")
>>> storage.list("a/")
['a/b.json']
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from jaxckpt.storage._base import PreconditionFailed as PreconditionFailed
from jaxckpt.storage._base import Storage as Storage
from jaxckpt.storage._base import TensorStoreStorage as TensorStoreStorage
from jaxckpt.storage._base import tensorstore_backed as tensorstore_backed
from jaxckpt.storage._buffers import aligned_empty as aligned_empty
from jaxckpt.storage._durable import fsync_dir as fsync_dir
from jaxckpt.storage._durable import makedirs_durable as makedirs_durable
from jaxckpt.storage._local import LocalStorage as LocalStorage
from jaxckpt.storage._options import DIRECT_PART_BYTES as DIRECT_PART_BYTES
from jaxckpt.storage._options import ObjectStoreOptions as ObjectStoreOptions
from jaxckpt.storage._options import span_limit as span_limit
from jaxckpt.storage._retry import STUCK_WRITE_S as STUCK_WRITE_S
from jaxckpt.storage._retry import no_space as no_space
from jaxckpt.storage._s3address import S3Address as S3Address
from jaxckpt.storage._s3address import resolve_style as resolve_style
from jaxckpt.storage._upload import FileUploads as FileUploads
from jaxckpt.storage._upload import upload_file as upload_file
from jaxckpt.storage._uri import OBJECT_SCHEMES
from jaxckpt.storage._uri import RootURI as RootURI
from jaxckpt.storage._uri import parse_root as parse_root

_OBJECT_PREFIXES = tuple(f"{scheme}://" for scheme in OBJECT_SCHEMES)

if TYPE_CHECKING:
    from jaxckpt.storage._object import ObjectStorage as ObjectStorage

Opener = Callable[[RootURI, ObjectStoreOptions, dict[str, Any]], Storage]
"""Opens a parsed root with the object-store options and the backend keyword arguments."""


def _open_local(root: RootURI, options: ObjectStoreOptions, kwargs: dict[str, Any]) -> Storage:
    return LocalStorage(root.path, **kwargs)


def _open_s3(root: RootURI, options: ObjectStoreOptions, kwargs: dict[str, Any]) -> Storage:
    from jaxckpt.storage._s3 import S3Storage

    return S3Storage(root, options)


def _open_gcs(root: RootURI, options: ObjectStoreOptions, kwargs: dict[str, Any]) -> Storage:
    from jaxckpt.storage._gcs import GcsStorage

    return GcsStorage(root, options)


BACKENDS: Mapping[str, Opener] = {"file": _open_local, "s3": _open_s3, "gs": _open_gcs}
"""The one table of backends: a root's scheme (:func:`parse_root`) -> its opener. The
cloud backends (TensorStore, HTTP clients) are imported when such a root is opened."""


def open_storage(
    root: str | os.PathLike[str],
    options: ObjectStoreOptions | Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> Storage:
    """Returns the :class:`Storage` for a root URI or path; sends no request.

    Args:
      root: a local path (``~`` expanded), ``file://`` URI,
        ``gs://bucket/prefix`` or ``s3://bucket/prefix``.
      options: :class:`ObjectStoreOptions` (or the same as a mapping) of an
        object-store root; ignored for local roots, so one options object can
        serve a local tier and its durable root.
      **kwargs: backend options: ``io_concurrency`` for local roots; fields of
        :class:`ObjectStoreOptions` (replacing those of ``options``) for
        object stores.

    Raises:
      StorageError: the root is not a valid root (``EINVAL``, naming it).
      TypeError / ValueError: an unknown option, or an invalid value.
    """

    def checked() -> ObjectStoreOptions:
        base = ObjectStoreOptions.from_mapping(options)
        return base.replace(**kwargs) if kwargs else base

    # An object store's options are checked first (they are the likelier mistake), then the root.
    text = os.fspath(root)
    early = checked() if text.startswith(_OBJECT_PREFIXES) else None
    if early is not None:
        early.check_scheme(text.partition("://")[0])
    parsed = parse_root(root)
    if parsed.scheme == "file":
        return BACKENDS["file"](parsed, ObjectStoreOptions(), kwargs)
    return BACKENDS[parsed.scheme](parsed, early or checked(), {})


def __getattr__(name: str) -> Any:
    if name == "ObjectStorage":  # the class, without importing TensorStore before it is needed
        from jaxckpt.storage._object import ObjectStorage

        return ObjectStorage
    raise AttributeError(f"module 'jaxckpt.storage' has no attribute {name!r}")


__all__ = [
    "DIRECT_PART_BYTES",
    "STUCK_WRITE_S",
    "FileUploads",
    "LocalStorage",
    "ObjectStorage",
    "ObjectStoreOptions",
    "PreconditionFailed",
    "RootURI",
    "S3Address",
    "Storage",
    "TensorStoreStorage",
    "aligned_empty",
    "fsync_dir",
    "makedirs_durable",
    "no_space",
    "open_storage",
    "parse_root",
    "resolve_style",
    "span_limit",
    "tensorstore_backed",
    "upload_file",
]
