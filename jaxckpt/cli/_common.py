"""What several commands share: opening a root, picking a step, retention flags."""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

from jaxckpt import policy
from jaxckpt._commit import CommitProtocol
from jaxckpt.errors import NotACheckpointRootError
from jaxckpt.storage import LocalStorage, open_storage


def open_root(uri: str, *, create: bool = False) -> CommitProtocol:
    """The protocol of an existing root (or, with ``create``, a new one).

    Raises:
      NotACheckpointRootError: the directory does not exist or has no root record.
    """
    storage = open_storage(uri)
    if not create and isinstance(storage, LocalStorage) and not os.path.isdir(storage.uri):
        raise NotACheckpointRootError(f"{storage.uri} does not exist")
    protocol = CommitProtocol(storage)
    protocol.ensure_root(create=create)
    return protocol


def split_source(text: str) -> tuple[str, int | None]:
    """``'gs://b/run:300'`` -> ``('gs://b/run', 300)``.

    >>> split_source("s3://bucket/run"), split_source("/tmp/run:12")
    (('s3://bucket/run', None), ('/tmp/run', 12))
    """
    root, sep, tail = text.rpartition(":")
    if sep and tail.isdigit() and root and not root.endswith(":/"):
        return root, int(tail)
    return text, None


def itemsize(dtype: str) -> int:
    """Bytes per element of a zarr v3 / numpy dtype name, without importing numpy.

    >>> itemsize("bfloat16"), itemsize("bool"), itemsize("complex64"), itemsize("float8_e4m3fn")
    (2, 1, 8, 1)
    """
    if dtype == "bool":
        return 1
    bits = re.search(r"\d+", dtype)
    return max(1, int(bits.group()) // 8) if bits else 1


def add_retention_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keep-last", type=int, metavar="K", help="keep the K newest steps")
    p.add_argument(
        "--keep-milestones",
        nargs="?",
        const="1,2,5",
        metavar="S,S,...",
        help="keep the first step at or after each s*10^j (default series 1,2,5)",
    )
    p.add_argument("--keep-every", type=int, metavar="N", help="keep steps that are multiples of N")


def retention(args: argparse.Namespace) -> policy.RetentionPolicy | None:
    series = None
    if args.keep_milestones is not None:
        series = [int(s) for s in args.keep_milestones.split(",") if s.strip()]
    return policy.retention_from(
        keep_last=args.keep_last, keep_milestones=series, keep_every=args.keep_every
    )


def command(sub: Any, name: str, fn: Any, help: str) -> argparse.ArgumentParser:
    """Adds subcommand ``name`` running ``fn(args) -> int``."""
    p: argparse.ArgumentParser = sub.add_parser(name, help=help, description=help)
    p.set_defaults(func=fn, parser=p)
    return p
