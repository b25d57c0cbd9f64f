"""Checks on an import source, made before anything is read into memory or written.

An import source is untrusted: its directories may link elsewhere, and its
metadata may claim arrays of any size (TensorStore allocates the claimed shape
when it reads one, whatever is on disk). So, before a byte of array data is read
and before the destination root is touched:

* every symbolic link under a step's directory must resolve inside the source
  directory (:func:`check_links`): a link out of it is refused, never followed;
* the arrays a step's metadata claims must fit a bound (:func:`check_claims`):
  ``max_bytes`` when given, else what this host can hold (its physical memory,
  or the address-space limit when one is set), since an import holds one step
  in memory;
* a step number must be one jaxckpt can store (at most ``2**63 - 1``).

Each refusal is one :class:`~jaxckpt.workflows.ImportSourceError` line that
names the path and the fix.
"""

from __future__ import annotations

import math
import os
import resource
from collections.abc import Iterable
from typing import Any

import numpy as np

from jaxckpt.workflows._import import ImportSourceError

__all__ = ["MAX_STEP", "check_claims", "check_links", "check_step_number", "host_memory"]

MAX_STEP = 2**63 - 1


def check_step_number(path: str, step: int | None) -> None:
    """Refuses a step directory numbered beyond what a jaxckpt step can be."""
    if step is not None and step > MAX_STEP:
        raise ImportSourceError(
            f"{path}: step {step} is larger than 2**63 - 1, the largest jaxckpt step; "
            "choose other steps, or import this one as another step (step=N, ROOT:N)"
        )


def _inside(path: str, boundary: str) -> bool:
    return path == boundary or path.startswith(boundary.rstrip(os.sep) + os.sep)


def check_links(boundary: str, path: str) -> None:
    """Refuses ``path`` (a step or item directory) if it, or anything under it, is a
    symbolic link that resolves outside ``boundary`` (the source directory, resolved).

    Links are never followed by the walk: a linked directory is checked, not entered.
    """
    boundary = os.path.realpath(boundary)

    def check(link: str) -> None:
        if os.path.islink(link) and not _inside(os.path.realpath(link), boundary):
            raise ImportSourceError(
                f"{link} is a symbolic link to {os.path.realpath(link)}, outside the import "
                f"source {boundary}: an import reads only what is inside its source (copy "
                "the data in, or import the linked checkpoint itself)"
            )

    check(path)
    for top, dirs, files in os.walk(path, followlinks=False):
        for name in (*dirs, *files):
            check(os.path.join(top, name))


def host_memory() -> int:
    """The bytes this process can hold: physical memory, or the address-space limit if lower."""
    try:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # not every platform names them
        physical = 1 << 40
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return min(physical, soft) if soft != resource.RLIM_INFINITY and soft > 0 else physical


def _claimed(shape: Any, dtype: Any) -> int | None:
    """The bytes an array of ``shape`` and ``dtype`` needs; None when they are not an array's."""
    try:
        dims = [int(d) for d in shape]
        itemsize = np.dtype(dtype).itemsize
    except (TypeError, ValueError, OverflowError):
        return None
    if any(d < 0 for d in dims):
        return None
    return math.prod(dims) * max(itemsize, 1)


def check_claims(
    item_path: str, arrays: Iterable[tuple[str, Any, Any]], used: int, bound: int
) -> int:
    """Adds up the bytes ``arrays`` (``(tree path, shape, dtype)``) claim; refuses the
    first that is not an array's or takes the total past ``bound``. Returns the total
    with ``used`` (what the step's earlier items claimed).
    """
    total = used
    for path, shape, dtype in arrays:
        nbytes = _claimed(shape, dtype)
        if nbytes is None:
            raise ImportSourceError(
                f"{item_path}: array {path} claims shape {shape} and dtype {dtype}, which "
                "no array has: the checkpoint is damaged"
            )
        total += nbytes
        if total > bound:
            raise ImportSourceError(
                f"{item_path}: array {path} claims shape {tuple(shape)} {np.dtype(dtype).name} "
                f"({_human(nbytes)}), taking the step to {_human(total)}, more than the "
                f"{_human(bound)} an import may hold; nothing was read or written. If the "
                "checkpoint is that large, pass max_bytes= (jaxckpt import --max-bytes)"
            )
    return total


def _human(n: int) -> str:
    from jaxckpt.saving import human_bytes

    return human_bytes(n)
