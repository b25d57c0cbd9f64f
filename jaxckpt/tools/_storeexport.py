"""safetensors exported into an object store (``s3://`` / ``gs://``) under a memory budget.

Each planned file is written as on a local disk (:mod:`jaxckpt.tools._leafwrite`,
under the budget) into a spool directory under the local temporary directory
(``TMPDIR``), uploaded from there in bounded parts (:func:`jaxckpt.storage.upload_file`:
S3 multipart, GCS resumable; one write when the file fits the budget) and deleted,
so local disk holds one shard at a time and memory never holds a shard whole. The
index goes last, in one write: it is what says the files are all there. The spool
directory (``jaxckpt-export-<pid>-<random>``) goes when the export ends, however it
ends; a killed process cannot remove its own, so each export first removes the spool
directories of processes of this host that are gone.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from jaxckpt.storage import open_storage, parse_root, upload_file

__all__ = ["export_to_store", "is_store_uri", "split_store_uri"]

_Members = TypeVar("_Members")
_log = logging.getLogger(__name__)

SPOOL_PREFIX = "jaxckpt-export-"
"""The name prefix of the spool directories under the local temporary directory."""


def is_store_uri(out: str) -> bool:
    """Whether ``out`` names an object store (``s3://``, ``gs://``)."""
    return out.startswith(("s3://", "gs://"))


def split_store_uri(out: str) -> tuple[str, str | None]:
    """``(directory URI, file name)`` of an object-store output: a URI ending in
    ``.safetensors`` below the bucket names one file, anything else a directory.

    Raises:
      StorageError: the URI (or its directory) is not a valid object-store root.
    """
    root = parse_root(out)  # checked whole before anything is split or sent
    if out.endswith(".safetensors") and root.prefix:
        parent, _, name = root.uri.rpartition("/")
        return parent, name
    return root.uri, None


def export_to_store(
    out: str,
    plan: Sequence[tuple[str, _Members]],
    write: Callable[[str, _Members], None],
    index: tuple[str, bytes] | None,
    *,
    part_bytes: int,
    progress: Callable[[int], None] | None = None,
    storage_options: Any = None,
) -> tuple[str, ...]:
    """Writes each ``(name, members)`` of ``plan`` with ``write(local path, members)``
    into a spool file, uploads it as ``<out>/<name>`` and deletes it; then ``index``
    (``(name, bytes)``), if any. Returns the URIs written, in order.

    Args:
      out: the directory URI (``s3://bucket/prefix`` or ``gs://bucket/prefix``).
      part_bytes: the most bytes of a file held in memory while it is uploaded.
      progress: told 0 after each part uploaded (a place to stop; the bytes were
        told while the file was written).
      storage_options: the destination's options (:func:`jaxckpt.storage.open_storage`).

    Raises:
      StorageError: the destination is invalid or failed (naming the object).
    """
    storage = open_storage(out, storage_options)
    remove_dead_spools()
    spool = tempfile.mkdtemp(prefix=f"{SPOOL_PREFIX}{os.getpid()}-")
    told = None if progress is None else (lambda nbytes: progress(0))
    written: list[str] = []
    try:
        for name, members in plan:
            path = os.path.join(spool, name)
            write(path, members)
            try:
                upload_file(storage, name, path, part_bytes=part_bytes, progress=told)
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            written.append(f"{storage.uri}/{name}")
        if index is not None:
            storage.write(index[0], index[1])
            written.append(f"{storage.uri}/{index[0]}")
    finally:
        shutil.rmtree(spool, ignore_errors=True)
    return tuple(written)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_dead_spools(directory: str | None = None) -> list[str]:
    """Removes the spool directories under ``directory`` (default: the temporary
    directory) whose process is gone (killed mid-export); returns them."""
    base = directory or tempfile.gettempdir()
    removed = []
    for path in glob.glob(os.path.join(glob.escape(base), f"{SPOOL_PREFIX}*-*")):
        pid = os.path.basename(path)[len(SPOOL_PREFIX) :].partition("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        _log.info("removed the spool directories of exports killed mid-way: %s", removed)
    return removed
