"""The parser, assembled from one module per command group, and ``main``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from jaxckpt.cli import (
    _analysis,
    _inspect,
    _interop,
    _ls,
    _manage,
    _mark,
    _plan,
    _promote,
    _report,
    _verify,
)
from jaxckpt.cli._output import dotted_paths, err
from jaxckpt.errors import CheckpointError

_COMMANDS = (_ls, _inspect, _verify, _manage, _mark, _promote, _analysis, _interop, _plan, _report)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("jaxckpt")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


def parser() -> argparse.ArgumentParser:
    """The ``jaxckpt`` argument parser with every subcommand."""
    p = argparse.ArgumentParser(
        prog="jaxckpt", description="Inspect, compare, convert and manage jaxckpt checkpoint roots."
    )
    p.add_argument("--version", action="version", version=f"jaxckpt {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in _COMMANDS:
        module.register(sub)
    return p


def _message(e: Exception) -> str:
    """The error's text without Python's ``[Errno N]`` prefix."""
    if isinstance(e, OSError) and e.strerror and e.filename is None:
        return str(e.strerror)
    return str(e)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``jaxckpt`` command line; returns the exit status."""
    args, extra = parser().parse_known_args(argv)
    if extra:  # report it with the subcommand's usage, not the top-level one
        args.parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.func(args))
    except CheckpointError as e:  # tree paths in the one form the CLI prints
        err(dotted_paths(_message(e)))
        return 1
    except BrokenPipeError:  # e.g. `jaxckpt ls ROOT | head`: stop quietly, like other tools
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as e:  # a storage failure not translated at the boundary
        err(_message(e))
        return 1
    except KeyboardInterrupt:
        err("interrupted")
        return 130
