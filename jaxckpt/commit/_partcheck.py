"""Committed steps whose marker covers manifest parts that are not stored.

A marker of format 4 covers ``manifest/0.json`` ... ``manifest/<n-1>.json``
for its ``num_processes`` (up to ``MAX_PROCESSES``) without listing them. A
full listing of the root (``jaxckpt ls``) tells how many are stored: a step
whose marker covers a part that is not stored (or claims more than are) is
damaged, not committed. The count is compared before anything is iterated, so
a marker claiming a million parts costs nothing. A step flagged from one
listing is listed again on its own before it is called damaged: its parts and
marker may have been written between the data listing and the marker's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from jaxckpt.records import (
    SELF_CHECKED_VERSION,
    CommitMarker,
    StepLocation,
    is_manifest_name,
    manifest_name,
    parse_data_key,
)
from jaxckpt.storage import Storage

__all__ = ["incomplete_steps", "missing_part", "stored_parts"]


def stored_parts(keys: Iterable[str]) -> dict[StepLocation, set[str]]:
    """The manifest part names stored for each attempt, from a listing of data keys."""
    out: dict[StepLocation, set[str]] = {}
    for key in keys:
        if "/manifest/" not in key:
            continue
        loc = parse_data_key(key)
        name = None if loc is None else loc.name_of(key)
        if loc is not None and name is not None and is_manifest_name(name):
            out.setdefault(loc, set()).add(name)
    return out


def missing_part(marker: CommitMarker, stored: set[str]) -> str | None:
    """What of the parts ``marker`` covers is not in ``stored`` (None: all are)."""
    claim = ""
    if marker.version >= SELF_CHECKED_VERSION and marker.parts is None:
        claimed = marker.num_processes
        # Never iterate a count read from storage: of the first len(stored) + 1 names
        # at least one is missing when more than that are claimed.
        names: Iterable[str] = (manifest_name(p) for p in range(min(claimed, len(stored) + 1)))
        if claimed > len(stored) + 1:
            claim = f" (it claims {claimed:,} parts; {len(stored):,} stored)"
    else:
        names = marker.manifest_names()
    gone = next((n for n in names if n not in stored), None)
    return None if gone is None else f"its marker covers {gone}, which is missing{claim}"


def _list_attempt(storage: Storage, marker: CommitMarker) -> set[str]:
    loc = marker.location
    prefixes = [loc.prefix, *(loc.bucket_prefix(b) for b in loc.buckets())]
    return stored_parts(k for p in prefixes for k in storage.list(p)).get(loc, set())


def incomplete_steps(
    storage: Storage, committed: Mapping[int, CommitMarker], data_keys: Iterable[str]
) -> dict[int, str]:
    """Committed steps (of ``committed``) with parts missing, and what is missing.

    Args:
      storage: the root, to list a flagged step's attempt again.
      committed: the visible markers, by step.
      data_keys: a listing of the root's data taken before the markers were read.
    """
    stored = stored_parts(data_keys)
    out: dict[int, str] = {}
    for step, marker in committed.items():
        if missing_part(marker, stored.get(marker.location, set())) is None:
            continue
        again = missing_part(marker, _list_attempt(storage, marker))
        if again is not None:
            out[step] = again
    return out
