"""Durable directory operations on a POSIX file system: the local backend's, and the peer
listener's when it streams a replica into a local root."""

from __future__ import annotations

import os


def fsync_dir(path: str) -> None:
    """Makes the entries of directory ``path`` (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def makedirs_durable(path: str) -> None:
    """Creates ``path`` and its parents, fsyncing each new directory's parent."""
    if os.path.isdir(path):
        return
    parent = os.path.dirname(path)
    if parent != path:
        makedirs_durable(parent)
    try:
        os.mkdir(path)
    except FileExistsError:
        return
    fsync_dir(parent)
