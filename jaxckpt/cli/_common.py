"""What several commands share: opening a root, picking a step, retention flags."""

from __future__ import annotations

import argparse
import math
import os
import re
from typing import Any

from jaxckpt import policy
from jaxckpt.commit import CommitProtocol
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


def source_and_step(
    parser: argparse.ArgumentParser, text: str, step: int | None
) -> tuple[str, int | None]:
    """The root and step of ``ROOT STEP`` or ``ROOT:STEP`` (both forms, not both at once).

    >>> p = argparse.ArgumentParser()
    >>> source_and_step(p, "/tmp/run:12", None), source_and_step(p, "/tmp/run", 12)
    (('/tmp/run', 12), ('/tmp/run', 12))
    """
    root, inline = split_source(text)
    if inline is not None and step is not None:
        parser.error(f"give the step once: {text} or {root} {step}, not both")
    return root, inline if step is None else step


def dotted(parts: Any, name: str | None = None) -> str:
    """The dotted display form of an encoded tree path, as ``diff``, ``stats`` and
    ``export`` print and accept it (``jaxckpt.open_step`` takes it too).

    >>> dotted([["d", "params"], ["a", "kernel"], ["s", 0]])
    'params.kernel.0'
    """
    return ".".join(str(key) for _, key in parts) or (name or "root")


def itemsize(dtype: str) -> int:
    """Bytes per element of a zarr v3 / numpy dtype name, without importing numpy.

    >>> itemsize("bfloat16"), itemsize("bool"), itemsize("complex64"), itemsize("float8_e4m3fn")
    (2, 1, 8, 1)
    """
    if dtype == "bool":
        return 1
    bits = re.search(r"\d+", dtype)
    return max(1, int(bits.group()) // 8) if bits else 1


def integer(minimum: int, maximum: int | None = None) -> Any:
    """An argparse ``type``: an integer in ``[minimum, maximum]``, else a one-line error.

    >>> integer(1)("3"), integer(0)(" 0 ")
    (3, 0)
    >>> integer(1)("0")
    Traceback (most recent call last):
    argparse.ArgumentTypeError: must be an integer >= 1, got '0'
    """
    bound = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {text!r}")
        return value

    return parse


def seconds(text: str) -> float:
    """An argparse ``type``: a finite number of seconds >= 0, else a one-line error.

    >>> seconds("1.5"), seconds("0")
    (1.5, 0.0)
    """
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text!r}")
    return value


def number(text: str) -> float:
    """An argparse ``type``: a finite number >= 0 (NaN and infinity are refused).

    >>> number("2.5")
    2.5
    """
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def step_list(text: str) -> list[int]:
    """An argparse ``type``: comma-separated integers >= 1 (``--keep-milestones``).

    >>> step_list("1,2,5")
    [1, 2, 5]
    """
    items = [s for s in text.split(",") if s.strip()]
    if not items or not all(s.strip().isdigit() and int(s) >= 1 for s in items):
        raise argparse.ArgumentTypeError(f"must be integers >= 1 separated by commas, got {text!r}")
    return [int(s) for s in items]


def add_retention_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keep-last", type=integer(1), metavar="K", help="keep the K newest steps")
    p.add_argument(
        "--keep-milestones",
        nargs="?",
        type=step_list,
        const=[1, 2, 5],
        metavar="S,S,...",
        help="keep the first step at or after each s*10^j (default series 1,2,5)",
    )
    p.add_argument(
        "--keep-every", type=integer(1), metavar="N", help="keep steps that are multiples of N"
    )


def retention(args: argparse.Namespace) -> policy.RetentionPolicy | None:
    return policy.retention_from(
        keep_last=args.keep_last, keep_milestones=args.keep_milestones, keep_every=args.keep_every
    )


def command(sub: Any, name: str, fn: Any, help: str) -> argparse.ArgumentParser:
    """Adds subcommand ``name`` running ``fn(args) -> int``."""
    p: argparse.ArgumentParser = sub.add_parser(name, help=help, description=help)
    p.set_defaults(func=fn, parser=p)
    return p
